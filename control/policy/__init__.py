"""Pure control-plane policies (no etcd, nats or torch): canary rollout analysis, diagnosis."""
