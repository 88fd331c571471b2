"""cachedstore: a coherent, read-through LRU cache in front of etcd v3.

The whole public API is importable from here::

    from cachedstore import EtcdStore

    with EtcdStore(host="localhost", port=2379, prefix="/myjob/") as store:
        store.set("master_addr", "10.0.0.1:29500")
        store.get("master_addr")            # b"10.0.0.1:29500", from the cache
"""

from .config import Backoff, LivenessPolicy, StoreConfig
from .errors import (
    AuthenticationError,
    CachedStoreError,
    ClusterMismatchError,
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionError,
    InvalidInputError,
    InvalidTypeError,
    KeyNotFoundError,
    LeaseNotFoundError,
    NotAnIntegerError,
    StoreClosedError,
    StoreForkedError,
    StoreTimeoutError,
    TLSError,
)
from .exposition import start_metrics_server
from .queues import QueueEmptyError
from .store import MISSING, EtcdStore, Snapshot, Versioned

__version__ = "0.1.0"

__all__ = [
    "MISSING",
    "AuthenticationError",
    "Backoff",
    "CachedStoreError",
    "ClusterMismatchError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdPermissionError",
    "EtcdStore",
    "InvalidInputError",
    "InvalidTypeError",
    "KeyNotFoundError",
    "LeaseNotFoundError",
    "NotAnIntegerError",
    "QueueEmptyError",
    "Snapshot",
    "StoreClosedError",
    "LivenessPolicy",
    "StoreConfig",
    "StoreForkedError",
    "StoreTimeoutError",
    "TLSError",
    "Versioned",
    "__version__",
    "start_metrics_server",
]
