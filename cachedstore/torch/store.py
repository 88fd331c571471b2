"""torch.distributed on etcd v3: a c10d ``Store`` and a torchrun rendezvous backend.

Two pieces, both on the cached :class:`~cachedstore.EtcdStore`:

* :class:`TorchEtcdStore` -- a ``torch.distributed.Store`` that torch's C++ (``PrefixStore``,
  ``ProcessGroupGloo``/``NCCL`` bootstrap, ``init_process_group(store=...)``) calls through its
  Python trampoline. A drop-in for torch's etcd-v2 ``EtcdStore`` or for ``TCPStore``::

      store = TorchEtcdStore("10.0.0.5", 2379, prefix="/jobs/42/")
      torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=n)

* :class:`EtcdV3RendezvousBackend` and :func:`create_rdzv_handler` -- a backend for torch's
  ``DynamicRendezvousHandler``, registered under the ``torchrun.handlers`` entry point as
  ``etcd-v3``::

      torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=etcd-v3 \\
               --rdzv-endpoint=etcd1:2379,etcd2:2379 --rdzv-id=job42 train.py

Lifetime: torch's C++ holds stores through pointers Python cannot see, and a Python store
whose last Python reference is gone can no longer be called from C++. A ``TorchEtcdStore``
therefore stays alive (with its etcd connection and watch) until :meth:`TorchEtcdStore.close`
or interpreter exit, whatever references remain; close it, or use it as a context manager.

Exceptions: a timeout (a ``get`` of a key nobody sets, ``wait``) raises
``torch.distributed.DistStoreError`` with "timeout" in its message, as torch's own stores do
and as torch's barrier loops expect; etcd unreachable raises
``torch.distributed.DistNetworkError``; every other cachedstore error becomes a
``DistStoreError``. The cachedstore exception is chained as ``__cause__``.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from etcd3 import etcdrpc

from .connection import IDEMPOTENT, UNSENT_ONLY
from .errors import CachedStoreError, EtcdConnectionError, StoreTimeoutError
from .store import EtcdStore

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_RDZV_PREFIX",
    "EtcdV3RendezvousBackend",
    "TorchEtcdStore",
    "create_backend",
    "create_rdzv_handler",
]

#: Default key prefix of a :class:`TorchEtcdStore`.
DEFAULT_PREFIX = "/torch/cachedstore/"
#: Default key prefix of the rendezvous backend (``--rdzv-conf prefix=...`` overrides it).
DEFAULT_RDZV_PREFIX = "/torch/elastic/v3/"
#: A "no timeout" wait (torch's ``kNoTimeout``, a zero timeout) is bounded by this instead.
_FOREVER = 365 * 24 * 3600.0

# Every open TorchEtcdStore, so that stores held only by torch's C++ stay callable.
_live: dict[int, TorchEtcdStore] = {}
_live_lock = threading.Lock()


def _close_live_stores() -> None:
    with _live_lock:
        stores = list(_live.values())
    for store in stores:
        try:
            store.close()
        except Exception:
            pass


atexit.register(_close_live_stores)


class _Shared:
    """The EtcdStore behind a TorchEtcdStore and its clones; closed once, by its owner."""

    __slots__ = ("etcd", "owned", "spec")

    def __init__(self, etcd: EtcdStore, owned: bool, spec: dict[str, Any] | None) -> None:
        self.etcd = etcd
        self.owned = owned
        self.spec = spec  # keyword arguments that rebuild it in another process, or None


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _translate(exc: CachedStoreError, what: str, waited: float | None = None) -> Exception:
    """The torch.distributed exception for a cachedstore error (the caller chains it)."""
    if isinstance(exc, StoreTimeoutError):
        after = f" after {_ms(waited)}ms" if waited is not None else ""
        return dist.DistStoreError(f"TorchEtcdStore: wait timeout{after}, {what}")
    if isinstance(exc, EtcdConnectionError):
        return dist.DistNetworkError(f"TorchEtcdStore: {what}: {exc}")
    return dist.DistStoreError(f"TorchEtcdStore: {what}: {exc}")


class TorchEtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3, read through a coherent local cache.

    Every process builds its own store against the same etcd and ``prefix``; they see one
    key space. Reads are served from the cache of an :class:`~cachedstore.EtcdStore`, kept
    coherent by one watch on ``prefix``; blocking reads (``get`` of a key not yet set,
    ``wait``, ``multi_get``) wait on that watch, without polling etcd and without a stream
    per waiter. ``add``, ``compare_set``, ``append`` and ``delete_key`` are compare-and-swap
    Txns on etcd: atomic across processes, never answered from a stale cache entry.

    Args:
        host, port: the etcd endpoint, unless ``endpoints`` is given in ``kwargs``.
        prefix: the etcd key prefix of the store (and the scope of its watch).
        timeout: the store timeout (``timedelta`` or seconds): how long ``get`` of an absent
            key and ``wait`` block before raising ``DistStoreError``. ``set_timeout``
            changes it; a zero timeout waits without limit, like torch's ``kNoTimeout``.
        store: an existing :class:`~cachedstore.EtcdStore` to use instead of connecting
            (its prefix is used; ``prefix`` and ``kwargs`` must not be given). It is not
            closed by :meth:`close`.
        kwargs: :class:`~cachedstore.EtcdStore` keywords: ``endpoints``, ``ca_cert``,
            ``cert_key``, ``cert_cert``, ``user``, ``password``, ``registry``,
            ``cache_size``, ``request_timeout``, ...

    Construction blocks until etcd answers (``connect_timeout``, 10 s by default) and
    raises ``DistNetworkError`` if it does not. Every method is thread-safe; C++ callers may
    call from any thread. The names torch's C++ calls (``getNumKeys``, ``deleteKey``) and
    the Python ones (``num_keys``, ``delete_key``) are both provided.

    The store lives until :meth:`close` (see the module docstring). :meth:`clone` returns a
    store sharing this one's etcd connection and cache; closing the original closes its
    clones' connection too. Pickling yields the connection settings, and unpickling in
    another process connects anew (a ``registry`` is not carried over).
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 2379,
        *,
        prefix: str | bytes | None = None,
        timeout: timedelta | float = timedelta(seconds=300),
        store: EtcdStore | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._closed = True  # until constructed: close() must work on a partial store
        if store is not None:
            if prefix is not None or kwargs:
                raise ValueError("give either store= or connection settings, not both")
            shared = _Shared(store, owned=False, spec=None)
        else:
            prefix = DEFAULT_PREFIX if prefix is None else prefix
            spec = {"host": host, "port": port, "prefix": prefix, **kwargs}
            try:
                etcd = EtcdStore(host, port, prefix=prefix, **kwargs)
            except CachedStoreError as exc:
                raise _translate(exc, "cannot connect to etcd") from exc
            shared = _Shared(etcd, owned=True, spec=spec)
        self._adopt(shared, timeout)

    def _adopt(self, shared: _Shared, timeout: timedelta | float) -> None:
        self._shared = shared
        self._etcd = shared.etcd
        self._owner = shared.owned
        self.set_timeout(timeout if isinstance(timeout, timedelta)
                         else timedelta(seconds=timeout))
        self._closed = False
        with _live_lock:
            _live[id(self)] = self

    @classmethod
    def _on(cls, shared: _Shared, timeout: timedelta | float) -> TorchEtcdStore:
        """A store on ``shared`` (a clone, or the rendezvous store owning its connection)."""
        store = cls.__new__(cls)
        dist.Store.__init__(store)
        store._closed = True
        store._adopt(shared, timeout)
        return store

    # -- properties ------------------------------------------------------------------------
    @property
    def etcd_store(self) -> EtcdStore:
        """The underlying :class:`~cachedstore.EtcdStore` (metrics, stats, watch health)."""
        return self._etcd

    @property
    def prefix(self) -> bytes:
        return self._etcd.prefix

    @property
    def closed(self) -> bool:
        return self._closed

    def _wait_seconds(self) -> float:
        seconds = self.timeout.total_seconds()
        return _FOREVER if seconds <= 0 else seconds

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"timeout={self.timeout.total_seconds():g}s"
        return f"TorchEtcdStore({self._etcd!r}, {state})"

    # -- the c10d Store interface ----------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key`` (one etcd put)."""
        try:
            self._etcd.set(key, value)
        except CachedStoreError as exc:
            raise _translate(exc, f"set {key!r}") from exc

    def get(self, key: str) -> bytes:
        """The value of ``key``; if absent, block until it is set or the store timeout
        passes (``DistStoreError``). A hit is served from the cache without a round trip."""
        wait = self._wait_seconds()
        try:
            return self._etcd.get(key, timeout=wait)  # type: ignore[no-any-return]
        except CachedStoreError as exc:
            raise _translate(exc, f"keys: [{key!r}]", wait) from exc

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer under ``key`` (0 if absent); return it."""
        try:
            return self._etcd.add(key, value)
        except CachedStoreError as exc:
            raise _translate(exc, f"add {key!r}") from exc

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is absent and
        ``expected_value`` is empty) and return the new value; else return the current value
        (``expected_value`` if absent). One etcd Txn, atomic across processes."""
        try:
            return self._etcd.compare_set(key, expected_value, desired_value)
        except CachedStoreError as exc:
            raise _translate(exc, f"compare_set {key!r}") from exc

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now (never blocks)."""
        try:
            return self._etcd.check(keys)
        except CachedStoreError as exc:
            raise _translate(exc, f"check {list(keys)!r}") from exc

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; ``timeout`` defaults to the store timeout."""
        wait = self._wait_seconds() if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout))
        if wait <= 0:
            wait = _FOREVER
        try:
            self._etcd.wait(keys, timeout=wait)
        except CachedStoreError as exc:
            raise _translate(exc, f"keys: {list(keys)!r}", wait) from exc

    def getNumKeys(self) -> int:  # noqa: N802 -- the name torch's C++ calls
        """How many keys exist under the store's prefix (one count-only etcd range)."""
        try:
            return self._etcd.num_keys()
        except CachedStoreError as exc:
            raise _translate(exc, "num_keys") from exc

    num_keys = getNumKeys

    def deleteKey(self, key: str) -> bool:  # noqa: N802 -- the name torch's C++ calls
        """Delete ``key``; True if it existed."""
        try:
            return self._etcd.delete(key)
        except CachedStoreError as exc:
            raise _translate(exc, f"delete_key {key!r}") from exc

    delete_key = deleteKey

    def append(self, key: str, value: bytes | str) -> None:
        """Atomically append ``value`` to the bytes under ``key`` (created if absent)."""
        try:
            self._etcd.append(key, value)
        except CachedStoreError as exc:
            raise _translate(exc, f"append {key!r}") from exc

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, blocking like :meth:`get` for absent ones. Cached keys
        cost nothing; the others are read together in as few Txns as etcd allows."""
        wait = self._wait_seconds()
        try:
            return self._etcd.mget(keys, timeout=wait)
        except CachedStoreError as exc:
            raise _translate(exc, f"keys: {list(keys)!r}", wait) from exc

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Write each value under its key: one etcd Txn per 128 keys (``EtcdStore.mset``)."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        try:
            self._etcd.mset(zip(keys, values, strict=True))
        except CachedStoreError as exc:
            raise _translate(exc, f"multi_set of {len(keys)} keys") from exc

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are implemented here."""
        return True

    def clone(self) -> TorchEtcdStore:
        """A store on the same etcd connection, cache and prefix, for use from another
        thread (torch's C++ clones stores for split and shrunk process groups). It lives
        until closed or until the store that owns the connection is closed."""
        if self._closed:
            raise dist.DistStoreError("TorchEtcdStore: clone of a closed store")
        shared = _Shared(self._etcd, owned=False, spec=self._shared.spec)
        return TorchEtcdStore._on(shared, self.timeout)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Forget the store; if it owns its etcd connection (it was not built around an
        existing EtcdStore, and is not a clone), close that connection and its watch.
        Idempotent. Blocks for at most a few seconds while the watch thread ends."""
        with _live_lock:
            _live.pop(id(self), None)
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._etcd.close()

    def __enter__(self) -> TorchEtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        spec = self._shared.spec
        if spec is None:
            raise TypeError("a TorchEtcdStore built around an existing EtcdStore cannot be "
                            "pickled; build it from connection settings instead")
        spec = {k: v for k, v in spec.items() if k != "registry"}
        return (_rebuild, (spec, self.timeout.total_seconds()))


def _rebuild(spec: dict[str, Any], timeout: float) -> TorchEtcdStore:
    spec = dict(spec)
    return TorchEtcdStore(spec.pop("host"), spec.pop("port"), timeout=timeout, **spec)


# --------------------------------------------------------------------------- rendezvous
# torchrun's entry point: defined before torch's rendezvous package is imported below. That
# package loads every ``torchrun.handlers`` entry point when it is first imported, this one
# included: if this module is what imports it, it finds ``create_rdzv_handler`` already
# defined instead of a partially initialised module.


def create_rdzv_handler(params: RendezvousParameters | None = None) -> Any:
    """torchrun's ``etcd-v3`` rendezvous handler: a ``DynamicRendezvousHandler`` whose state
    lives in etcd v3 and whose store is a :class:`TorchEtcdStore` under a run-scoped prefix.

    ``--rdzv-endpoint``: ``host[:port]``, or several separated by commas (default port
    2379). ``--rdzv-conf`` keys, besides torch's own (``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``,
    ``keep_alive_interval``, ...): ``cacert`` (CA bundle; enables TLS), ``cert`` and ``key``
    (client certificate), ``user`` and ``password`` (etcd auth), ``prefix`` (default
    ``/torch/elastic/v3/``), ``ttl`` (seconds the state outlives its last write, default
    7200), ``store_timeout`` (the store's timeout, default 300 s), ``request_timeout`` and
    ``connect_timeout`` (seconds). torch's etcd-v2 names ``ca_cert``, ``ssl_cert``,
    ``ssl_cert_key`` and ``read_timeout`` are accepted too.

    Worker restarts: torch 2.13's agents by default keep one TCPStore, hosted by the rank-0
    agent, for the workers of every round, and a restarted gloo group then reads the
    previous round's peer addresses from it and fails (torch's own ``c10d`` backend fails
    the same way). Unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is set, or
    ``--rdzv-conf share_agent_store=1`` asks for torch's default, this handler therefore
    sets that variable to ``1`` in the agent process: each round's rank-0 worker hosts a
    fresh TCPStore, whose address the agents exchange through this etcd store.

    Called with ``params``, returns the handler. Called without arguments -- how torchrun
    loads a ``torchrun.handlers`` entry point (it registers ``entry_point.load()()``) --
    returns this function itself, the handler creator.
    """
    if params is None:
        return create_rdzv_handler
    if not params.get_as_bool("share_agent_store", False):
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    backend, store = create_backend(params)
    try:
        handler: RendezvousHandler = create_handler(store, backend, params)
    except BaseException:
        store.close()
        raise
    return handler


from torch.distributed.elastic.rendezvous import (  # noqa: E402 -- see above
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import (  # noqa: E402
    parse_rendezvous_endpoint,
)


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A ``RendezvousBackend`` for torch's ``DynamicRendezvousHandler`` on etcd v3.

    The rendezvous state lives in one key, ``<key_prefix><run_id>/state``. ``set_state`` is
    one Txn: compare the key's ``mod_revision`` with the fencing token (or its absence when
    there is no token), put on success, read the key on failure. The token is the key's
    ``mod_revision``. The key is attached to a lease, so an abandoned rendezvous disappears:
    it expires between ``ttl`` and ``1.5 × ttl`` after the last write (a backend reuses one
    lease of ``1.5 × ttl`` for ``ttl / 2``, so that a heartbeat every few seconds does not
    create a lease each time). ``ttl`` defaults to two hours, like torch's etcd backend.

    Args:
        store: the :class:`~cachedstore.EtcdStore` whose connection the backend uses (its
            prefix does not matter: the backend addresses whole keys). Not closed here.
        run_id: the rendezvous id (``--rdzv-id``).
        key_prefix: where rendezvous keys live.
        ttl: seconds; None or <= 0 means two hours.

    Thread-safe (torch calls it from the agent's main thread and its keep-alive timer).
    Raises ``RendezvousConnectionError`` when etcd cannot be reached.
    """

    DEFAULT_TTL = 7200.0

    def __init__(self, store: EtcdStore, run_id: str, *, key_prefix: str = DEFAULT_RDZV_PREFIX,
                 ttl: float | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._conn = store._conn  # noqa: SLF001 -- the backend speaks raw Txns
        self._key = f"{key_prefix}{run_id}/state".encode()
        self._ttl = float(ttl) if ttl and ttl > 0 else self.DEFAULT_TTL
        self._lease_lock = threading.Lock()
        self._lease_id = 0
        self._lease_renew_at = 0.0

    @property
    def name(self) -> str:
        return "etcd-v3"

    @property
    def key(self) -> bytes:
        """The etcd key holding the rendezvous state."""
        return self._key

    @property
    def ttl(self) -> float:
        return self._ttl

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its token (``mod_revision``), or None; one linearizable read."""
        try:
            response = self._conn.call("range", etcdrpc.RangeRequest(key=self._key),
                                       deadline=self._conn.deadline(), retry=IDEMPOTENT)
        except CachedStoreError as exc:
            raise RendezvousConnectionError(
                f"etcd-v3 rendezvous: reading {self._key!r} failed: {exc}") from exc
        if not response.kvs:
            return None
        kv = response.kvs[0]
        return bytes(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored token is still ``token`` (absent when None); return
        (state, token, True) on success, else the stored (state, token, False), or None if
        there is no state. One Txn (plus a lease grant every ``ttl / 2``)."""
        if token is not None:
            try:
                token = int(token)
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
        if token:
            compare = etcdrpc.Compare(key=self._key, result=etcdrpc.Compare.EQUAL,
                                      target=etcdrpc.Compare.MOD, mod_revision=token)
        else:
            compare = etcdrpc.Compare(key=self._key, result=etcdrpc.Compare.EQUAL,
                                      target=etcdrpc.Compare.CREATE, create_revision=0)
        state = bytes(state)
        for attempt in range(2):
            lease = self._lease()
            request = etcdrpc.TxnRequest(
                compare=[compare],
                success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                    key=self._key, value=state, lease=lease))],
                failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=self._key))])
            try:
                response = self._conn.call("txn", request, deadline=self._conn.deadline(),
                                           retry=UNSENT_ONLY)
            except EtcdConnectionError as exc:
                return self._after_unknown_outcome(state, exc)
            except CachedStoreError as exc:
                if "lease not found" in str(exc) and attempt == 0:
                    self._forget_lease(lease)  # expired or revoked under us: take a new one
                    continue
                raise RendezvousConnectionError(
                    f"etcd-v3 rendezvous: writing {self._key!r} failed: {exc}") from exc
            if response.succeeded:
                return state, response.header.revision, True
            kvs = response.responses[0].response_range.kvs
            if not kvs:
                return None
            return bytes(kvs[0].value), kvs[0].mod_revision, False
        raise RendezvousStateError("etcd-v3 rendezvous: the state key's lease keeps vanishing")

    def _after_unknown_outcome(self, state: bytes, exc: Exception
                               ) -> tuple[bytes, Token, bool] | None:
        """The Txn may or may not have been applied: read the key and decide. The state
        carries per-node heartbeat times, so equal bytes mean our write landed."""
        try:
            current = self.get_state()
        except RendezvousConnectionError:
            raise RendezvousConnectionError(
                f"etcd-v3 rendezvous: writing {self._key!r} failed: {exc}") from exc
        if current is None:
            return None
        value, token = current
        return value, token, value == state

    def _lease(self) -> int:
        """A lease id to attach the state to, granted anew every ``ttl / 2``."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease_id and now < self._lease_renew_at:
                return self._lease_id
            request = etcdrpc.LeaseGrantRequest(TTL=math.ceil(self._ttl * 1.5), ID=0)
            try:
                response = self._conn.call("lease_grant", request,
                                           deadline=self._conn.deadline(), retry=IDEMPOTENT)
            except CachedStoreError as exc:
                raise RendezvousConnectionError(
                    f"etcd-v3 rendezvous: granting a lease failed: {exc}") from exc
            if response.error:
                raise RendezvousConnectionError(
                    f"etcd-v3 rendezvous: granting a lease failed: {response.error}")
            self._lease_id = response.ID
            self._lease_renew_at = now + self._ttl / 2
            return self._lease_id

    def _forget_lease(self, lease: int) -> None:
        with self._lease_lock:
            if self._lease_id == lease:
                self._lease_id = 0


def _endpoints(endpoint: str | None) -> list[str]:
    """``"h1:2379,h2"`` → ``["h1:2379", "h2:2379"]``; empty → ``["localhost:2379"]``."""
    out = []
    for part in (endpoint or "").split(","):
        if part.strip():
            host, port = parse_rendezvous_endpoint(part, default_port=2379)
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return out or ["localhost:2379"]


def _conf(params: RendezvousParameters, *names: str) -> str | None:
    for name in names:
        value = params.get(name)
        if value not in (None, ""):
            return str(value)
    return None


def _conf_seconds(params: RendezvousParameters, name: str) -> float | None:
    value = _conf(params, name)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"--rdzv-conf {name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"--rdzv-conf {name} must be > 0 seconds, got {value!r}")
    return seconds


def create_backend(params: RendezvousParameters
                   ) -> tuple[EtcdV3RendezvousBackend, TorchEtcdStore]:
    """The backend and the worker-facing store for ``params`` (see :func:`create_rdzv_handler`
    for the ``--rdzv-conf`` keys). Connects to etcd; raises RendezvousConnectionError."""
    prefix = _conf(params, "prefix") or DEFAULT_RDZV_PREFIX
    if not prefix.endswith("/"):
        prefix += "/"
    cert = _conf(params, "cert", "ssl_cert")
    key = _conf(params, "key", "ssl_cert_key")
    if (cert is None) != (key is None):
        raise ValueError("--rdzv-conf: give both cert= and key=, or neither")
    user, password = _conf(params, "user"), _conf(params, "password")
    if (user is None) != (password is None):
        raise ValueError("--rdzv-conf: give both user= and password=, or neither")
    store_timeout = _conf_seconds(params, "store_timeout") or 300.0
    try:
        etcd = EtcdStore(
            endpoints=_endpoints(params.endpoint),
            prefix=f"{prefix}{params.run_id}/store/",
            ca_cert=_conf(params, "cacert", "ca_cert"), cert_cert=cert, cert_key=key,
            user=user, password=password,
            request_timeout=_conf_seconds(params, "request_timeout") or _conf_seconds(
                params, "read_timeout"),
            connect_timeout=_conf_seconds(params, "connect_timeout"))
    except CachedStoreError as exc:
        raise RendezvousConnectionError(
            f"etcd-v3 rendezvous: cannot connect to etcd at {params.endpoint!r}: {exc}"
        ) from exc
    store = TorchEtcdStore._on(_Shared(etcd, owned=True, spec=None), store_timeout)
    backend = EtcdV3RendezvousBackend(etcd, params.run_id, key_prefix=prefix,
                                      ttl=_conf_seconds(params, "ttl"))
    return backend, store
