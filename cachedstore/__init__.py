"""cachedstore: a coherent read-through cache in front of etcd v3."""
