"""``actorserve deploy k8s``: Kubernetes manifests per model version and pool, scaled by KEDA (issue [27] item 3).

The autoscaler actor decides desired replica counts (docs/autoscaling.md); on Kubernetes nothing of actorserve
carries them out: its leader exports them as the gauge ``actorserve_autoscaler_desired_replicas``
(actors/autoscaler/export.py) and one KEDA ``ScaledObject`` per scaled Deployment follows it through Prometheus:

* a ``prometheus`` trigger whose query is the target's series (``max(...)`` over the autoscaler pods: only the
  leader exports one), ``metricType: AverageValue`` and ``threshold: "1"``. KEDA serves the query's value as an
  external metric; HPA's formula for an AverageValue target is ``ceil(value / threshold)`` whatever the current
  replica count (:func:`hpa_replicas`), so the Deployment gets the desired count;
* ``minReplicaCount`` / ``maxReplicaCount``: the autoscaler's floor and ceiling of that target (the same
  defaults: :data:`DEFAULT_WORKER_LIMITS`, :data:`DEFAULT_VALIDATOR_LIMITS`, from ``AutoscalerConfig``). A floor
  of 0 (scale to zero, another pool) lets KEDA take the Deployment to 0 when the value is 0 (KEDA's activation:
  active while the value is above ``activationThreshold`` 0) and back to 1 when it is not; HPA (min 1) does the
  rest;
* no series (no leader, Prometheus away): ``ignoreNullValues: "false"`` makes the scaler fail, and HPA keeps
  the current count (what an absent desired record means under ``up``);
* scale-down that lets a worker drain: one pod at a time per ``terminationGracePeriodSeconds``, which covers the
  worker's drain on SIGTERM (``--drain-timeout`` + the lease revoke + its stop slack).

Rendered per version: the scheduler Deployment (active + standby, not scaled) and its PDB; per version and pool:
the worker Deployment (``--pool``), its PDB and its ScaledObject; and one ScaledObject for the base's
``actorserve-validator``. ``deploy/k8s/base/actors/models.yaml`` and ``deploy/k8s/keda/keda.yaml`` are this
module's output for the default model (``python -m control.ops.k8s_render`` rewrites them; the tests fail while
they are stale). No PyYAML at run time: :func:`to_yaml` writes the small subset these documents need.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.autoscaler.export import METRIC

DEFAULT_MODEL = "smollm2-135m-instruct@1"
DEFAULT_POOL = "local"  # the autoscaler's --pool default (AutoscalerConfig.pool)
DEFAULT_WORKER_LIMITS = (1, 2)  # AutoscalerConfig.worker_limits
DEFAULT_VALIDATOR_LIMITS = (1, 2)  # AutoscalerConfig.cpu_limits["validator"]
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
DEFAULT_DRAIN_TIMEOUT_S = 10.0  # the worker's --drain-timeout default
DEFAULT_KV_CACHE_BYTES = 268435456
ETCD_URL = "http://actorserve-etcd:2379"
NATS_HOST = "actorserve-nats:4222"
LABELS = {"app.kubernetes.io/name": "actorserve", "app.kubernetes.io/part-of": "actorserve"}
#: HPA's default tolerance: a change of the ratio within 10 % is ignored (10 -> 9, 11 -> 12, ...)
HPA_TOLERANCE = 0.1
ROOT = Path(__file__).resolve().parents[2]
BASE_MODELS = ROOT / "deploy" / "k8s" / "base" / "actors" / "models.yaml"
KEDA_OVERLAY = ROOT / "deploy" / "k8s" / "keda" / "keda.yaml"


@dataclass(frozen=True)
class WorkerTarget:
    """Workers of one model version on one pool, with the autoscaler's floor and ceiling for them."""

    name: str
    version: str
    pool: str = DEFAULT_POOL
    floor: int = DEFAULT_WORKER_LIMITS[0]
    ceiling: int = DEFAULT_WORKER_LIMITS[1]

    def __post_init__(self) -> None:
        from control.state.names import validate_name

        validate_name("model name", self.name)
        validate_name("version", self.version)
        validate_name("pool name", self.pool)
        _check_limits(self.floor, self.ceiling)


@dataclass(frozen=True)
class RenderConfig:
    workers: tuple[WorkerTarget, ...] = field(default_factory=lambda: (parse_worker(DEFAULT_MODEL),))
    validators: tuple[int, int] = DEFAULT_VALIDATOR_LIMITS
    prometheus: str = DEFAULT_PROMETHEUS
    image: str = "actorserve:latest"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    polling_s: int = 5  # KEDA's pollingInterval (s): how often it checks activation (0 <-> 1)
    cooldown_s: int = 30  # KEDA's cooldownPeriod (s): 1 -> 0 after the value stayed 0 this long

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker target (--worker NAME@VERSION)")
        keys = [(w.name, w.version, w.pool) for w in self.workers]
        if len(set(keys)) != len(keys):
            raise ValueError("a version and pool named twice")
        _check_limits(*self.validators)
        if not 0 < self.drain_timeout_s <= 3600 or self.kv_cache_bytes <= 0:
            raise ValueError("drain timeout must be in (0, 3600] s and the KV cache > 0 bytes")
        if not re.fullmatch(r"https?://\S+", self.prometheus):
            raise ValueError(f"{self.prometheus!r} is no http(s) URL of a Prometheus server")

    @property
    def grace_s(self) -> int:
        """The worker's terminationGracePeriodSeconds: its drain (``--drain-timeout``), the lease revoke and
        credits (up to 4 s) and its stop slack (5 s), with margin."""
        return int(math.ceil(self.drain_timeout_s)) + 20


def _check_limits(floor: int, ceiling: int) -> None:
    if not (isinstance(floor, int) and isinstance(ceiling, int) and 0 <= floor <= ceiling and ceiling >= 1):
        raise ValueError(f"limits {floor}:{ceiling}: need 0 <= floor <= ceiling, ceiling >= 1")


def parse_span(text: str) -> tuple[int, int]:
    """``FLOOR:CEILING`` -> (floor, ceiling); ValueError naming the problem."""
    floor, sep, ceiling = text.partition(":")
    try:
        out = (int(floor), int(ceiling))
    except ValueError:
        sep = ""
    if not sep:
        raise ValueError(f"{text!r} is not FLOOR:CEILING")
    _check_limits(*out)
    return out


def parse_worker(text: str, limits: tuple[int, int] = DEFAULT_WORKER_LIMITS, pool: str = DEFAULT_POOL) -> WorkerTarget:
    """``NAME@VERSION[/POOL][=FLOOR:CEILING]`` -> WorkerTarget (ValueError naming the problem)."""
    ref, eq, span = text.partition("=")
    ref, slash, pool_part = ref.partition("/")
    name, at, version = ref.partition("@")
    if not at or (slash and not pool_part) or (eq and not span):
        raise ValueError(f"{text!r} is not NAME@VERSION[/POOL][=FLOOR:CEILING]")
    floor, ceiling = parse_span(span) if eq else limits
    return WorkerTarget(name, version, pool_part or pool, floor, ceiling)


# -- names ---------------------------------------------------------------------------------------


def dns_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from actorserve names (``_`` -> ``-``); shortened with a hash past ``limit``."""
    text = "-".join(p.replace("_", "-") for p in parts).strip("-")
    text = re.sub(r"-{2,}", "-", text)
    if len(text) <= limit:
        return text
    digest = hashlib.sha256("/".join(parts).encode()).hexdigest()[:8]
    return f"{text[:limit - 9].rstrip('-')}-{digest}"


def label_value(value: str) -> str:
    """A Kubernetes label value for an actorserve name (at most 63 characters, ends alphanumeric)."""
    if len(value) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9_.-]*[a-z0-9])?", value):
        return value
    return dns_name(value)


def scheduler_name(w: WorkerTarget) -> str:
    return dns_name("actorserve-scheduler", w.name, w.version)


def worker_name(w: WorkerTarget) -> str:
    return dns_name("actorserve-worker", w.name, w.version, w.pool)


def query(w: WorkerTarget | None) -> str:
    """The PromQL of a target's desired count (``None``: the validators)."""
    if w is None:
        return f'max({METRIC}{{tier="validator"}})'
    return f'max({METRIC}{{tier="worker",model="{w.name}",version="{w.version}",pool="{w.pool}"}})'


# -- HPA's arithmetic (pure) ---------------------------------------------------------------------


def hpa_replicas(value: float, current: int, floor: int, ceiling: int, threshold: float = 1.0,
                 tolerance: float = HPA_TOLERANCE) -> int:
    """The replica count KEDA and HPA give a ScaledObject with one AverageValue trigger whose query returns
    ``value``, from ``current`` replicas (one round).

    At 0 replicas HPA does not act: KEDA scales to 1 when the trigger is active (``value`` > its
    activationThreshold 0), else stays. Otherwise HPA (minReplicas ``max(floor, 1)``): ``ratio = value /
    (threshold * current)``; within ``tolerance`` of 1 nothing changes, else ``ceil(value / threshold)``,
    clamped to [minReplicas, ceiling]. With floor 0, KEDA takes a Deployment at 1 to 0 once the trigger is
    inactive (after cooldownPeriod)."""
    if current == 0:
        return max(floor, 1) if value > 0 else floor
    if floor == 0 and value <= 0 and current == 1:
        return 0
    ratio = value / (threshold * current)
    desired = current if abs(1.0 - ratio) <= tolerance else math.ceil(value / threshold)
    return max(max(floor, 1), min(ceiling, desired))


# -- documents -----------------------------------------------------------------------------------


def _env(role: str) -> list[dict]:
    return [
        {"name": "NATS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "actorserve-nats-roles", "key": role}}},
        {"name": "ACTORSERVE_NATS", "value": f"nats://actorserve-{role}:$(NATS_PASSWORD)@{NATS_HOST}"},
        {"name": "ACTORSERVE_JS_REPLICAS", "value": "3"},
        {"name": "ACTORSERVE_LOG_LEVEL", "value": "INFO"},
    ]


def _probe(command: list[str], period: int, failures: int, timeout: int | None = 3) -> dict:
    out: dict[str, Any] = {"exec": {"command": command}, "periodSeconds": period}
    if timeout:
        out["timeoutSeconds"] = timeout
    out["failureThreshold"] = failures
    return out


METRICS_URL = "http://127.0.0.1:9100/metrics"


def _deployment(name: str, kind: str, labels: dict, selector: dict, args: list[str], cfg: RenderConfig, *,
                replicas: int | None, grace_s: int, ready: list[str], startup_failures: int, resources: dict) -> dict:
    spec: dict[str, Any] = {}
    if replicas is not None:
        spec["replicas"] = replicas
    spec.update({
        "revisionHistoryLimit": 3,
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "selector": {"matchLabels": selector},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "serviceAccountName": "actorserve",
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": grace_s,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": kind,
                    "image": cfg.image,
                    "imagePullPolicy": "IfNotPresent",
                    "args": args,
                    "env": _env(kind),
                    "readinessProbe": _probe(ready, 5, 2),
                    "livenessProbe": _probe(["actorserve-probe", METRICS_URL], 10, 6),
                    "startupProbe": _probe(["actorserve-probe", METRICS_URL], 2, startup_failures, None),
                    "resources": resources,
                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "state", "mountPath": "/var/lib/actorserve"},
                                     {"name": "kernels", "mountPath": "/var/cache/actorserve/kernels"},
                                     {"name": "tmp", "mountPath": "/tmp"}],
                }],
                "volumes": [{"name": "state", "emptyDir": {}}, {"name": "kernels", "emptyDir": {}},
                            {"name": "tmp", "emptyDir": {}}],
            },
        },
    })
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels}, "spec": spec}


def _pdb(name: str, labels: dict, selector: dict, **budget: int) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "labels": labels},
            "spec": {**budget, "selector": {"matchLabels": selector}}}


def _model_labels(kind: str, w: WorkerTarget) -> tuple[dict, dict]:
    """(pod labels, selector) of a version's scheduler or a version-and-pool's workers."""
    sel = {"app.kubernetes.io/name": "actorserve", "app.kubernetes.io/component": kind,
           "actorserve.io/model": label_value(w.name), "actorserve.io/model-version": label_value(w.version)}
    if kind == "worker":
        sel["actorserve.io/pool"] = label_value(w.pool)
    labels = {**LABELS, "app.kubernetes.io/component": kind, "actorserve.io/actor-kind": kind, **sel}
    return labels, sel


def scheduler_docs(w: WorkerTarget, cfg: RenderConfig) -> list[dict]:
    labels, sel = _model_labels("scheduler", w)
    args = ["actor", "scheduler", "--model", f"{w.name}@{w.version}", "--metrics-port", "9100", "--etcd", ETCD_URL]
    dep = _deployment(scheduler_name(w), "scheduler", labels, sel, args, cfg, replicas=2, grace_s=30,
                      ready=["actorserve-probe", METRICS_URL], startup_failures=60,
                      resources={"requests": {"cpu": "500m", "memory": "512Mi"},
                                 "limits": {"cpu": "2", "memory": "1Gi"}})
    return [dep, _pdb(scheduler_name(w), labels, sel, minAvailable=1)]


def worker_docs(w: WorkerTarget, cfg: RenderConfig) -> list[dict]:
    """The worker Deployment (no ``replicas``: its ScaledObject owns the count; 1 until KEDA acts) and PDB."""
    labels, sel = _model_labels("worker", w)
    drain = f"{cfg.drain_timeout_s:g}"
    args = ["actor", "worker", "--model", f"{w.name}@{w.version}", "--pool", w.pool, "--drain-timeout", drain,
            "--kv-cache-bytes", str(cfg.kv_cache_bytes), "--no-progress", "--metrics-port", "9100", "--etcd", ETCD_URL]
    dep = _deployment(worker_name(w), "worker", labels, sel, args, cfg, replicas=None, grace_s=cfg.grace_s,
                      ready=["actorserve-probe", "--require", "actorserve_kv_cache_usage_perc", METRICS_URL],
                      startup_failures=180,
                      resources={"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}})
    return [dep, _pdb(worker_name(w), labels, sel, maxUnavailable=1)]


def scaled_object(name: str, target: str, floor: int, ceiling: int, promql: str, cfg: RenderConfig, *,
                  labels: dict, drain_period_s: int) -> dict:
    """A ScaledObject following one desired count (module docstring)."""
    scale_up: dict[str, Any] = {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                                "policies": [{"type": "Pods", "value": ceiling, "periodSeconds": 15}]}
    # one pod per drain period: each leaving worker moves its sequences to ones that stay; 15 s smooths the
    # series' scrape lag (the autoscaler's own windows already held the decision back)
    scale_down: dict[str, Any] = {"stabilizationWindowSeconds": 15, "selectPolicy": "Max",
                                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": drain_period_s}]}
    if ceiling >= 10:  # HPA's 10 % tolerance would ignore a change of one from 10 replicas up (hpa_replicas)
        scale_up["tolerance"] = scale_down["tolerance"] = "0"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "pollingInterval": cfg.polling_s,
            "cooldownPeriod": cfg.cooldown_s,
            "minReplicaCount": floor,
            "maxReplicaCount": ceiling,
            "advanced": {
                "restoreToOriginalReplicaCount": False,
                "horizontalPodAutoscalerConfig": {"behavior": {"scaleUp": scale_up, "scaleDown": scale_down}},
            },
            "triggers": [{
                "type": "prometheus",
                "name": "desired-replicas",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": cfg.prometheus,
                    "query": promql,
                    "threshold": "1",
                    "activationThreshold": "0",
                    "ignoreNullValues": "false",
                },
            }],
        },
    }


def model_docs(cfg: RenderConfig) -> list[dict]:
    """Scheduler (per version) and worker (per version and pool) Deployments and PDBs."""
    out, seen = [], set()
    for w in cfg.workers:
        if (w.name, w.version) not in seen:
            seen.add((w.name, w.version))
            out += scheduler_docs(w, cfg)
        out += worker_docs(w, cfg)
    return out


def keda_docs(cfg: RenderConfig) -> list[dict]:
    """The ScaledObjects: the validators', then one per version and pool."""
    vlabels = {**LABELS, "app.kubernetes.io/component": "validator", "actorserve.io/actor-kind": "validator"}
    out = [scaled_object("actorserve-validator", "actorserve-validator", *cfg.validators, query(None), cfg,
                         labels=vlabels, drain_period_s=30)]
    for w in cfg.workers:
        labels, _ = _model_labels("worker", w)
        out.append(scaled_object(worker_name(w), worker_name(w), w.floor, w.ceiling, query(w), cfg,
                                 labels=labels, drain_period_s=cfg.grace_s))
    return out


# -- YAML ------------------------------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z/][A-Za-z0-9_./@-]*")
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        if _PLAIN.fullmatch(v) and v.lower() not in _RESERVED:
            return v
        return json.dumps(v)  # a double-quoted YAML scalar
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings, ints, bools (the subset of these documents)."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "{}\n"
        out = []
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{_scalar(k)}:\n" + to_yaml(v, indent + 2 if isinstance(v, dict) else indent))
            else:
                out.append(f"{pad}{_scalar(k)}: {'{}' if v == {} else '[]' if v == [] else _scalar(v)}\n")
        return "".join(out)
    if isinstance(obj, list):
        out = []
        for item in obj:
            body = to_yaml(item, indent + 2) if isinstance(item, (dict, list)) and item else \
                f"{pad}  {'{}' if item == {} else '[]' if item == [] else _scalar(item)}\n"
            out.append(f"{pad}- {body[indent + 2:]}")
        return "".join(out)
    return pad + _scalar(obj) + "\n"


def yaml_stream(docs: list[dict], header: str = "") -> str:
    return header + "---\n".join(to_yaml(d) for d in docs)


def _header(cfg: RenderConfig, what: str) -> str:
    refs = " ".join(f"--worker {w.name}@{w.version}/{w.pool}={w.floor}:{w.ceiling}" for w in cfg.workers)
    return (f"# {what}\n# Generated by `actorserve deploy k8s {refs} --validators {cfg.validators[0]}:"
            f"{cfg.validators[1]}` (control/ops/k8s_render.py); do not edit: re-render. docs/deployment.md.\n")


def render_files(cfg: RenderConfig) -> dict[str, str]:
    """``{file name: text}`` of a rendered directory: models.yaml, keda.yaml, kustomization.yaml."""
    return {
        "models.yaml": yaml_stream(model_docs(cfg), _header(cfg, "Schedulers and workers per model version and pool.")),
        "keda.yaml": yaml_stream(keda_docs(cfg), _header(cfg, "KEDA ScaledObjects following the autoscaler's "
                                                              "desired counts (needs KEDA and Prometheus).")),
        "kustomization.yaml": ("# Apply after deploy/k8s/base (which holds the other actors, NATS and etcd).\n"
                               + to_yaml({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                          "resources": ["models.yaml", "keda.yaml"]})),
    }


def default_files() -> dict[Path, str]:
    """The committed outputs for the default model: the base's models.yaml and the KEDA overlay's keda.yaml."""
    files = render_files(RenderConfig())
    return {BASE_MODELS: files["models.yaml"], KEDA_OVERLAY: files["keda.yaml"]}


# -- CLI -----------------------------------------------------------------------------------------


def add_deploy_command(sub: Any) -> None:
    """``actorserve deploy k8s``."""
    p = sub.add_parser("deploy", help="render deployment manifests (Kubernetes with KEDA)")
    ps = p.add_subparsers(dest="deploy_command", metavar="TARGET", required=True)
    k = ps.add_parser("k8s", help="Deployments per model version and pool, and KEDA ScaledObjects following "
                      "the autoscaler's desired counts", description=__doc__.split("\n\n")[0])
    k.add_argument("--worker", action="append", default=[], metavar="NAME@VERSION[/POOL][=F:C]",
                   help="a model version's workers on a pool (default pool local) with the autoscaler's floor:ceiling "
                   "for them (default --worker-limits); repeatable (default: smollm2-135m-instruct@1)")
    k.add_argument("--worker-limits", default="%d:%d" % DEFAULT_WORKER_LIMITS, metavar="F:C",
                   help="floor:ceiling of a --worker without one: the autoscaler's --worker-limits "
                   "(default %(default)s)")
    k.add_argument("--validators", default="%d:%d" % DEFAULT_VALIDATOR_LIMITS, metavar="F:C",
                   help="floor:ceiling of the validators: the autoscaler's --limits validator=F:C "
                   "(default %(default)s)")
    k.add_argument("--prometheus", default=DEFAULT_PROMETHEUS, metavar="URL",
                   help="Prometheus server KEDA queries (default %(default)s)")
    k.add_argument("--image", default="actorserve:latest", help="container image (default %(default)s)")
    k.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="the workers' --drain-timeout; their grace period is S + 20 (default %(default)s)")
    k.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES, metavar="N",
                   help="the workers' --kv-cache-bytes (default %(default)s)")
    k.add_argument("--out", default=None, metavar="DIR",
                   help="write models.yaml, keda.yaml, kustomization.yaml there (default: print one stream)")
    k.set_defaults(func=_cmd_k8s)


def config_from_args(args: argparse.Namespace) -> RenderConfig:
    limits = parse_span(args.worker_limits)
    workers = tuple(parse_worker(w, limits) for w in (args.worker or [DEFAULT_MODEL]))
    return RenderConfig(workers=workers, validators=parse_span(args.validators), prometheus=args.prometheus,
                        image=args.image, drain_timeout_s=args.drain_timeout, kv_cache_bytes=args.kv_cache_bytes)


def _cmd_k8s(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"actorserve deploy k8s: {exc}", file=sys.stderr)
        return 2
    files = render_files(cfg)
    if args.out is None:
        sys.stdout.write(files["models.yaml"] + "---\n" + files["keda.yaml"])
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"wrote {', '.join(sorted(files))} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m control.ops.k8s_render [--check]``: rewrite (or check) the committed default outputs."""
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = [p for p, text in default_files().items() if not p.exists() or p.read_text() != text]
    if check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for p, text in default_files().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
