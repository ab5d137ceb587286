"""The actor kinds: which module runs each, a one-line description, which kinds serve one model version.

Read by the CLI (``actorserve actor KIND``), the supervisor (``actorserve up``) and the NATS roles; a new
actor kind is added here (docs/architecture.md, "Adding an actor").
"""

from __future__ import annotations

#: actor kind -> module exposing add_arguments(parser) and async main(args)
ACTOR_MODULES = {
    "gateway": "gateway.actor",
    "validator": "actors.validator.actor",
    "scheduler": "actors.scheduler.actor",
    "worker": "actors.worker.actor",
    "jobs": "actors.jobs.actor",
    "rollout": "actors.rollout.actor",
    "autoscaler": "actors.autoscaler.actor",
}
ACTOR_HELP = {
    "gateway": "HTTP (OpenAI-compatible) and NATS API edge",
    "validator": "chat templating, tokenization and request validation (queue group)",
    "scheduler": "fair queues, admission and dispatch for one model version",
    "worker": "loads one model version and runs the engine",
    "jobs": "runs durable async jobs (JetStream) at batch priority",
    "rollout": "canary analysis: steps, promotes or rolls back rollouts (etcd election, one active)",
    "autoscaler": "desired replica counts of validators, gateways and workers from live signals (etcd election)",
}
MODEL_ACTORS = ("scheduler", "worker")
