"""State of the control plane in etcd: model registry, tenants, routing tables, elections, names and keys."""
