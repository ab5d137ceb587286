"""Operations: the CLI, the supervisor behind `actorserve up`, the embedded nats-server / etcd, deployment helpers."""
