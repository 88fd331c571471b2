"""The exceptions cachedstore raises.

Every error derives from :class:`CachedStoreError` *and* from the built-in exception a
caller would naturally catch, so both ``except cachedstore.CachedStoreError`` and
``except KeyError`` (or ``TimeoutError``, ``ConnectionError``, ...) work::

    CachedStoreError
    ├── KeyNotFoundError          (KeyError)          get() of an absent key, no default
    │   └── QueueEmptyError                           a non-blocking pop of an empty queue
    ├── StoreTimeoutError         (TimeoutError)      a blocking get()/wait() ran out of time
    ├── EtcdConnectionError       (ConnectionError)   etcd unreachable, or the outcome unknown
    │   ├── TLSError                                  the TLS handshake with etcd failed
    │   └── ClusterMismatchError                      an endpoint belongs to another cluster
    ├── EtcdPermissionError       (PermissionError)   etcd RBAC denied the request
    │   └── AuthenticationError                       wrong user name or password
    ├── InvalidInputError         (ValueError)        empty name, value over etcd's limit, ...
    │   └── NotAnIntegerError                         add() on a value that is not an integer
    ├── InvalidTypeError          (TypeError)         a name or value that is not str or bytes
    ├── LeaseNotFoundError        (LookupError)       the lease expired or was revoked
    ├── StoreClosedError          (RuntimeError)      the store was closed
    │   └── StoreForkedError                          used in a child forked after creation
    └── EtcdError                 (RuntimeError)      any other error etcd reported

No raw ``grpc.RpcError`` escapes the public API: each is translated into one of these, with
the original chained as ``__cause__``. Messages never contain credentials.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CachedStoreError",
    "ClusterMismatchError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdPermissionError",
    "InvalidInputError",
    "InvalidTypeError",
    "KeyNotFoundError",
    "LeaseNotFoundError",
    "NotAnIntegerError",
    "QueueEmptyError",
    "StoreClosedError",
    "StoreForkedError",
    "StoreTimeoutError",
    "TLSError",
]


class CachedStoreError(Exception):
    """Root of every exception raised by cachedstore."""


class KeyNotFoundError(CachedStoreError, KeyError):
    """The key does not exist and no default or timeout was given."""

    def __init__(self, name: object) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:  # KeyError's str() would print only repr(name)
        return f"key not found: {self.name!r}"


class QueueEmptyError(KeyNotFoundError):
    """A non-blocking ``queue_pop`` found the queue empty (a KeyError); ``name`` is the
    queue's."""

    def __str__(self) -> str:
        return f"queue is empty: {self.name!r}"


class StoreTimeoutError(CachedStoreError, TimeoutError):
    """A blocking operation did not complete within its timeout."""


class EtcdConnectionError(CachedStoreError, ConnectionError):
    """etcd could not be reached within the request timeout (on any endpoint).

    For writes that are not idempotent (``add``, ``compare_set``) raised after the request
    may have reached etcd, the message says that the outcome is unknown.
    """


class TLSError(EtcdConnectionError):
    """The TLS handshake failed: an untrusted server certificate or a rejected client one."""


class ClusterMismatchError(EtcdConnectionError):
    """An endpoint answered as a member of another etcd cluster than the one the store
    first reached (a different ``cluster_id`` in its response headers). It is never used:
    serving or resuming a watch from another cluster's revisions would mix two histories."""


class EtcdPermissionError(CachedStoreError, PermissionError):
    """etcd's RBAC refused the request (the user's roles do not cover the key)."""


class AuthenticationError(EtcdPermissionError):
    """etcd rejected the user name and password, or authentication is not enabled."""


class InvalidInputError(CachedStoreError, ValueError):
    """A name or value that etcd would reject: empty, too large, not encodable."""


class NotAnIntegerError(InvalidInputError):
    """``add`` was called on a key whose value is not a decimal integer."""


class InvalidTypeError(CachedStoreError, TypeError):
    """A name or value of a type other than ``str`` or ``bytes``."""


class LeaseNotFoundError(CachedStoreError, LookupError):
    """etcd does not know the lease a write named: it expired or was revoked."""


class StoreClosedError(CachedStoreError, RuntimeError):
    """The store was closed; no further operations are possible."""


class StoreForkedError(StoreClosedError):
    """The store was created before ``os.fork()`` and used in the child, which has no watch
    thread and cannot use the parent's gRPC channels: create a new store in the child."""


class EtcdError(CachedStoreError, RuntimeError):
    """etcd returned an error that has no more specific class above."""
