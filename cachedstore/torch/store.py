"""The c10d ``Store``: :class:`TorchEtcdStore`, a ``torch.distributed.Store`` on etcd v3.

torch's C++ (``PrefixStore``, ``ProcessGroupGloo``/``NCCL`` bootstrap,
``init_process_group(store=...)``) calls it through its Python trampoline. A drop-in for
torch's etcd-v2 ``EtcdStore`` or for ``TCPStore``::

    store = TorchEtcdStore("10.0.0.5", 2379, prefix="/jobs/42/")
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=n)

Lifetime: torch's C++ holds stores through pointers Python cannot see, and a Python store
whose last Python reference is gone can no longer be called from C++. A ``TorchEtcdStore``
therefore stays alive (with its etcd connection and watch) until :meth:`TorchEtcdStore.close`
or interpreter exit, whatever references remain; close it, or use it as a context manager.

Exceptions, as torch's own stores raise them and torch's barrier loops expect them:

- a blocking call (``get`` of an absent key, ``wait``, ``multi_get``, blocking
  ``queue_pop``) that runs out of time raises ``torch.distributed.DistStoreError`` with
  "timeout" in its message -- also when etcd became unreachable during the wait: reads are
  retried (with back-off) until the wait's own deadline, and then it is a timeout;
- a non-blocking ``queue_pop`` of an empty queue raises ``torch.distributed.QueueEmptyError``;
- etcd unreachable outside a wait, or a TLS failure, raises ``DistNetworkError``;
- every other cachedstore error becomes a ``DistStoreError``.

The cachedstore exception is chained as ``__cause__``.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from .. import counters, queues
from ..clock import SYSTEM_CLOCK, Clock
from ..config import Backoff
from ..errors import (
    CachedStoreError,
    EtcdConnectionError,
    StoreTimeoutError,
    TLSError,
)
from ..scoping import Scope
from ..store import EtcdStore

__all__ = ["DEFAULT_PREFIX", "PASSWORD_ENV", "TorchEtcdStore", "read_password"]

T = TypeVar("T")

#: Default key prefix of a :class:`TorchEtcdStore`.
DEFAULT_PREFIX = "/torch/cachedstore/"
#: The environment variable a password is read from when none is given (as the CLI does).
PASSWORD_ENV = "CACHEDSTORE_PASSWORD"
#: torch's error for a non-blocking pop of an empty queue (torch < 2.8 has no queues and no
#: QueueEmptyError: a DistStoreError then).
_QueueEmpty: type[Exception] = getattr(dist, "QueueEmptyError", dist.DistStoreError)
#: A "no timeout" wait (torch's ``kNoTimeout``, a zero timeout) is bounded by this instead.
_FOREVER = 365 * 24 * 3600.0
#: Back-off between reads of a wait that found etcd unreachable (until the wait's deadline).
_OUTAGE_BACKOFF = Backoff(initial=0.05, maximum=1.0)

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


def read_password(password_file: str | None = None) -> str | None:
    """The etcd password from ``password_file`` (its first line) or, without a file, from
    ``$CACHEDSTORE_PASSWORD``; None if neither is set. Raises ValueError naming the file if
    it cannot be read or is empty."""
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read the etcd password file {password_file!r}: "
                             f"{exc.strerror}") from None
        if not password:
            raise ValueError(f"the etcd password file {password_file!r} is empty")
        return password
    return os.environ.get(PASSWORD_ENV) or None


class _Shared:
    """The EtcdStore behind a TorchEtcdStore and its clones; closed once, by its owner."""

    __slots__ = ("etcd", "owned", "spec")

    def __init__(self, etcd: EtcdStore, owned: bool, spec: dict[str, Any] | None) -> None:
        self.etcd = etcd
        self.owned = owned
        # Keyword arguments that rebuild it in another process (never a password), or None.
        self.spec = spec


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _translate(exc: CachedStoreError, what: str, waited: float | None = None) -> Exception:
    """The torch.distributed exception for a cachedstore error (the caller chains it)."""
    if isinstance(exc, queues.QueueEmptyError):
        return _QueueEmpty(f"TorchEtcdStore: {what}: queue is empty")
    if isinstance(exc, StoreTimeoutError):
        return _timeout(what, waited)
    if isinstance(exc, EtcdConnectionError):
        return dist.DistNetworkError(f"TorchEtcdStore: {what}: {exc}")
    return dist.DistStoreError(f"TorchEtcdStore: {what}: {exc}")


def _timeout(what: str, waited: float | None) -> Exception:
    after = f" after {_ms(waited)}ms" if waited is not None else ""
    return dist.DistStoreError(f"TorchEtcdStore: wait timeout{after}, {what}")


class TorchEtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3, read through a coherent local cache.

    Every process builds its own store against the same etcd and ``prefix``; they see one
    key space. Reads are served from the cache of an :class:`~cachedstore.EtcdStore`, kept
    coherent by one watch stream; by default (``watch_scope="touched"``) it watches only
    the keys and directories this store's reads touched -- a rank's own process groups,
    not every group of the job -- and falls back to the whole prefix past ``max_watches``
    (64) of them. ``watch_scope="prefix"`` watches the whole prefix. Blocking reads
    (``get`` of a key not yet set, ``wait``, ``multi_get``, ``queue_pop``) wait on that
    watch, without polling etcd and without a stream per waiter. ``add`` (one Txn that no
    other ``add`` can make retry), ``compare_set``, ``append``, ``delete_key`` and the
    queue operations are Txns on etcd: atomic across processes, never answered from a
    stale cache entry.

    Args:
        host, port: the etcd endpoint, unless ``endpoints`` is given in ``kwargs``.
        prefix: the etcd key prefix of the store (and the scope of its watch).
        timeout: the store timeout (``timedelta`` or seconds): how long ``get`` of an absent
            key, ``wait`` and ``queue_pop`` block before raising ``DistStoreError``.
            ``set_timeout`` changes it; a zero timeout waits without limit (``kNoTimeout``).
        store: an existing :class:`~cachedstore.EtcdStore` to use instead of connecting
            (its prefix is used; ``prefix`` and ``kwargs`` must not be given). It is not
            closed by :meth:`close`.
        password_file: with ``user``, read the password from this file's first line.
            Without ``password`` and ``password_file``, a ``user``'s password is read from
            ``$CACHEDSTORE_PASSWORD``.
        clock: times the retries of waits during an outage (tests pass a FakeClock).
        kwargs: :class:`~cachedstore.EtcdStore` keywords: ``endpoints``, ``ca_cert``,
            ``cert_key``, ``cert_cert``, ``user``, ``password``, ``registry``,
            ``cache_size``, ``request_timeout``, ...

    Construction blocks until etcd answers (``connect_timeout``, 10 s by default) and
    raises ``DistNetworkError`` if it does not. Every method is thread-safe; C++ callers may
    call from any thread. The names torch's C++ calls (``getNumKeys``, ``deleteKey``) and
    the Python ones (``num_keys``, ``delete_key``) are both provided.

    Queues (``queue_push``, ``queue_pop``, ``queue_len``) and ``list_keys`` work when called
    from Python. torch 2.13's C++ trampoline does not forward them to Python stores, so
    through a C++ ``PrefixStore`` they raise torch's ``NotImplementedError``.

    The store lives until :meth:`close` (see the module docstring). :meth:`clone` returns a
    store sharing this one's etcd connection and cache; closing the original closes its
    clones' connection too. Pickling yields the connection settings -- never a password:
    a store whose password came from ``password_file`` or ``$CACHEDSTORE_PASSWORD`` is
    rebuilt reading the same file or variable in the other process; one given
    ``password=`` in code refuses to be pickled (TypeError). A ``registry`` is not carried
    over.

    Longer than this project's classes usually are: it is torch's whole ``Store`` API, each
    method with torch's semantics and its error translation documented; the logic lives in
    :class:`~cachedstore.EtcdStore` and its components.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 2379,
        *,
        prefix: str | bytes | None = None,
        timeout: timedelta | float = timedelta(seconds=300),
        store: EtcdStore | None = None,
        password_file: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._closed = True  # until constructed: close() must work on a partial store
        if store is not None:
            if prefix is not None or kwargs or password_file:
                raise ValueError("give either store= or connection settings, not both")
            shared = _Shared(store, owned=False, spec=None)
        else:
            prefix = DEFAULT_PREFIX if prefix is None else prefix
            # torch keeps every process group's keys under one store: a rank watches the
            # directories of its own groups, not the job's (EtcdStore's watch_scope),
            # unless a given config or keyword says otherwise.
            if kwargs.get("config") is None:
                kwargs.setdefault("watch_scope", "touched")
            spec: dict[str, Any] = {"host": host, "port": port, "prefix": prefix, **kwargs}
            spec.pop("password", None)
            inline = kwargs.get("password") is not None
            if password_file:
                spec["password_file"] = password_file
            if kwargs.get("user") is not None and not inline:
                kwargs["password"] = read_password(password_file)
                if kwargs["password"] is None:
                    raise ValueError(f"user {kwargs['user']!r} needs a password: give "
                                     f"password_file= or set ${PASSWORD_ENV}")
            if inline:
                spec["_inline_password"] = True
            try:
                etcd = EtcdStore(host, port, prefix=prefix, **kwargs)
            except CachedStoreError as exc:
                raise _translate(exc, "cannot connect to etcd") from exc
            shared = _Shared(etcd, owned=True, spec=spec)
        self._adopt(shared, timeout, clock)

    def _adopt(self, shared: _Shared, timeout: timedelta | float, clock: Clock,
               scope: Callable[[], str] | None = None) -> None:
        self._shared = shared
        self._etcd = shared.etcd
        self._owner = shared.owned
        self._clock = clock
        self._scope = scope
        self.set_timeout(timeout if isinstance(timeout, timedelta)
                         else timedelta(seconds=timeout))
        self._closed = False
        with _live_lock:
            _live[id(self)] = self

    @classmethod
    def _on(cls, shared: _Shared, timeout: timedelta | float, clock: Clock = SYSTEM_CLOCK,
            scope: Callable[[], str] | None = None) -> TorchEtcdStore:
        """A store on ``shared`` (a clone, or the rendezvous store owning its connection).
        ``scope``, if given, returns the name prefix of every key, evaluated per call."""
        store = cls.__new__(cls)
        dist.Store.__init__(store)
        store._closed = True
        store._adopt(shared, timeout, clock, scope)
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

    def _store_timeout(self) -> timedelta:
        return self.timeout  # type: ignore[attr-defined] # torch's property

    def _wait_seconds(self, timeout: timedelta | float | None = None) -> float:
        if timeout is None:
            seconds = self._store_timeout().total_seconds()
        else:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) \
                else float(timeout)
        return _FOREVER if seconds <= 0 or seconds != seconds else min(seconds, _FOREVER)

    def _name(self, key: str | bytes) -> str | bytes:
        scope = self._scope
        if scope is None:
            return key
        if not isinstance(key, str):
            key = bytes(key).decode("utf-8", "surrogateescape")
        return scope() + key

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"timeout={self._store_timeout().total_seconds():g}s"
        return f"TorchEtcdStore({self._etcd!r}, {state})"

    # -- blocking reads: a wait that meets an outage ends as a timeout ---------------------
    def _until_deadline(self, what: str, wait: float, attempt: Callable[[float], T],
                        start: float | None = None) -> T:
        """Run ``attempt(remaining seconds)``, its etcd round trips given what remains;
        while it fails because etcd is unreachable and the wait's deadline (``wait``
        seconds from ``start``, a ``clock.monotonic()`` value; now if None) has not
        passed, back off and try again. A timeout -- the attempt's own, or the deadline
        reached during an outage -- raises torch's timeout error; other errors their
        torch equivalents."""
        clock = self._clock
        deadline = (clock.monotonic() if start is None else start) + wait
        failures = 0
        while True:
            try:
                left = max(0.0, deadline - clock.monotonic())
                # The attempt's looks (reads that do not wait) are this operation's: each
                # round trip may take what is left of it (and request_timeout), not 250 ms
                # (ReadThrough.within): under a slow etcd, no look fails early, to be
                # retried on a new connection while etcd still serves the first.
                with self._etcd._reads.within(left):  # noqa: SLF001
                    return attempt(left)
            except TLSError as exc:  # a configuration error: waiting will not fix it
                raise _translate(exc, what) from exc
            except EtcdConnectionError as exc:
                remaining = deadline - clock.monotonic()
                if remaining <= 0:
                    raise _timeout(what, wait) from exc
                clock.sleep(min(remaining, _OUTAGE_BACKOFF.delay(failures)))
                failures += 1
            except CachedStoreError as exc:
                raise _translate(exc, what, wait) from exc

    # -- the c10d Store interface ----------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``: one etcd Txn that writes unless the key holds
        that value already (``EtcdStore.set_if_changed``). Nothing torch can observe
        differs, but torch's store-based barrier has every rank that sees the count
        complete set ``last_worker``: that costs one watch event per waiting rank, not
        one per waiting rank per setter (W² at worst)."""
        try:
            self._etcd.set_if_changed(self._name(key), value)
        except CachedStoreError as exc:
            raise _translate(exc, f"set {key!r}") from exc

    def get(self, key: str) -> bytes:
        """The value of ``key``; if absent, block until it is set or the store timeout
        passes (``DistStoreError``). A hit is served from the cache without a round trip."""
        name = self._name(key)
        etcd = self._etcd
        start = None
        try:
            cached = name in etcd._entries  # noqa: SLF001
        except TypeError:  # unhashable: the look below says why (or reads it)
            cached = False
        try:
            if cached:  # the hot path, no deadline arithmetic
                # timeout=0: a complete cache answers "absent" without asking etcd. (An
                # entry the cache holds but cannot serve now -- its watch is down or
                # resyncing -- is looked at as a bare read: 250 ms.)
                value = etcd.get(name, None, timeout=0)
                if value is not None:
                    return value
            else:
                start = self._clock.monotonic()
                value = self._first_look(name)
                if value is not None:
                    return value
        except EtcdConnectionError:
            pass  # the blocking path below retries until the deadline
        except CachedStoreError as exc:
            raise _translate(exc, f"keys: [{key!r}]") from exc
        first = True  # the first attempt knows the key absent: no second look first

        def attempt(left: float) -> bytes:
            nonlocal first
            absent, first = first, False
            return self._get_blocking([name], left, absent)[0]
        return self._until_deadline(f"keys: [{key!r}]", self._wait_seconds(), attempt, start)

    def _first_look(self, name: str | bytes) -> bytes | None:
        """``get``'s first look at a key the cache does not hold: it may read etcd, for a
        ``get`` that waits if the key is absent, so its round trips get what is left of
        the store timeout (up to ``request_timeout``), not a bare look's 250 ms. Under a
        slow etcd a 250 ms look failed, and the read was sent again on a new connection
        while etcd still served the first. (Deciding which look to make costs a hit
        ~25 ns; the operation's context ~1 µs, paid by misses only.)"""
        etcd = self._etcd
        with etcd._reads.within(self._wait_seconds()):  # noqa: SLF001
            return etcd.get(name, None, timeout=0)

    def _get_blocking(self, names: list[str | bytes], wait: float,
                      absent: bool = False) -> list[bytes]:
        """The values of ``names``, waiting (on the watch, within ``wait`` seconds) for the
        absent ones (``absent``: the caller just found every name absent, so the first
        step waits at once): the look that finds them all present answers, no other
        follows. StoreTimeoutError at the deadline, without another etcd read."""
        clock = self._clock
        deadline = clock.monotonic() + wait
        missing = names
        if not absent:
            values = self._etcd.mget(names, None, timeout=0)
            missing = [n for n, v in zip(names, values, strict=True) if v is None]
            if not missing:
                return values
        found: list[bytes] = []

        def ready() -> bool:
            # The values themselves: the read that finds every name present answers.
            values = self._etcd.mget(names, None, timeout=0)
            if any(v is None for v in values):
                return False
            found[:] = values
            return True

        # Asked at once (the waiters are registered first: a put since the look above
        # wakes them), then at every change of a missing name, until the deadline.
        self._etcd.wait_until(ready, names=list(dict.fromkeys(missing)),
                              timeout=max(0.0, deadline - clock.monotonic()), clock=clock)
        return found

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer under ``key`` (0 if absent); return it.

        ``add(key, 0)`` on an absent key creates it holding 0, as torch's HashStore,
        FileStore and TCPStore do (``get`` then returns ``b"0"``, ``check`` is true,
        ``num_keys`` counts it): see :meth:`_add_zero`."""
        name = self._name(key)
        try:
            if isinstance(value, int) and not isinstance(value, bool) and value == 0:
                return self._add_zero(name, key)
            return self._etcd.add(name, value)
        except CachedStoreError as exc:
            raise _translate(exc, f"add {key!r}") from exc

    def _add_zero(self, name: str | bytes, key: object) -> int:
        """``add(name, 0)``: the counter's value, creating the key (a counter of base 0,
        the layout ``add(name, n)`` creates) if it is absent.

        An existing key costs what ``EtcdStore.add(name, 0)`` costs: one read-only Txn,
        no raft proposal, no revision. etcd sends any Txn that holds a put, in either
        branch, through raft, so the create is a second Txn, sent only when that read found
        the key absent: "never put" → put the marker (and clear parts an earlier life of
        the counter may have left), else → read the counter whole (someone created it in
        between). It is sent under the store's write protocol (registered in flight, its
        outcome reported to the cache as a write or as a fill)."""
        etcd = self._etcd
        # The store's internals, as EtcdStore.add uses them (its add(k, 0) leaves an absent
        # key absent, and torch's stores do not).
        with etcd._timed("add"):  # noqa: SLF001 -- observed like EtcdStore.add
            canonical = etcd._keys.canonical(name)  # noqa: SLF001
            etcd._check_open()  # noqa: SLF001
            found = etcd._reads.read_counters([canonical])[canonical]  # noqa: SLF001
            if found is not None:
                return found if isinstance(found, int) else counters.parse_int(found, key)
            value = etcd._writes.create_counter(canonical)  # noqa: SLF001
            if isinstance(value, int):
                return value
            # A plain value someone set in between (the key exists: the compare failed).
            return counters.parse_int(value.value, key) if value is not None else 0

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """torch 2.13's ``Store.barrier``, natively: :meth:`EtcdStore.barrier` (one raft
        proposal per rank, all released by one watch event). ``timeout`` defaults to the
        store timeout; its passing raises DistStoreError ("timeout"), like torch's."""
        wait = self._wait_seconds(timeout)
        try:
            self._etcd.barrier(self._name(key), world_size, wait)
        except CachedStoreError as exc:
            raise _translate(exc, f"barrier {key!r} (world_size={world_size})", wait) from exc

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is absent and
        ``expected_value`` is empty) and return the new value; else return the current value
        (``expected_value`` if absent). One etcd Txn, atomic across processes."""
        try:
            return self._etcd.compare_set(self._name(key), expected_value, desired_value)
        except CachedStoreError as exc:
            raise _translate(exc, f"compare_set {key!r}") from exc

    def _has_key(self, name: str | bytes) -> bool:
        """True if the key exists (a complete cache answers "absent" without etcd).
        EtcdConnectionError if etcd could not be asked: unknown, not absent."""
        try:
            self._etcd.wait([name], timeout=0)
        except StoreTimeoutError as exc:
            # A look whose first read answered but whose second could not reach etcd (its
            # cache incomplete) times out for the outage: unknown, not absent.
            if isinstance(exc.__cause__, EtcdConnectionError):
                raise exc.__cause__ from None
            return False
        return True

    def _present(self, name: str | bytes,
                 opened: tuple[Scope, int, int] | None = None) -> bool:
        """torch's notion of "exists" for check and wait: a key, or a non-empty queue
        (``opened``: what ``queues.open_directory`` returned)."""
        return self._has_key(name) or self._etcd.queues.is_nonempty(name, opened)

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now, as a key or as a non-empty queue (never blocks)."""
        names = [self._name(k) for k in keys]
        try:
            # Watching what it touched: the keys' scopes and the queues' in one read.
            opened = self._etcd.queues.open_directory(names)
            if self._etcd.check(names):
                return True
            if len(names) == 1:  # the key is absent: only its queue can make it exist
                return self._etcd.queues.is_nonempty(names[0], opened)
            # Each name's look reads etcd as check's own read did (request_timeout), not
            # as a bare look that does not wait (250 ms).
            with self._etcd._reads.within(self._etcd.config.request_timeout):  # noqa: SLF001
                return all(self._present(n, opened) for n in names)
        except CachedStoreError as exc:
            raise _translate(exc, f"check {list(keys)!r}") from exc

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, as a key or as a non-empty queue; ``timeout``
        defaults to the store timeout. Woken by the store's watch, no polling."""
        names = [self._name(k) for k in keys]
        self._until_deadline(f"keys: {list(keys)!r}", self._wait_seconds(timeout),
                             lambda left: self._wait_present(names, left))

    def _wait_present(self, names: list[str | bytes], wait: float) -> None:
        """Block until every name exists (as a key or as a non-empty queue), woken by the
        watch; StoreTimeoutError after ``wait`` seconds (the reads before the wait count
        against them), raised at the deadline without reading etcd again."""
        clock = self._clock
        deadline = clock.monotonic() + wait
        # Watching what it touched: the keys' scopes and the queues' in one read.
        opened = self._etcd.queues.open_directory(names)
        try:
            self._etcd.wait(names, timeout=0)
            return  # every key exists: the common case, answered from the cache
        except StoreTimeoutError:
            pass
        missing = list(dict.fromkeys(names))

        def present() -> bool:
            nonlocal missing
            missing = [n for n in missing if not self._present(n, opened)]
            return not missing

        # 0 when the deadline passed during the reads above: a timeout.
        self._etcd.wait_until(present, names=missing, queues=missing,
                              timeout=max(0.0, deadline - clock.monotonic()), clock=clock)

    def getNumKeys(self) -> int:  # noqa: N802 -- the name torch's C++ calls
        """How many keys exist under the store's prefix, queue items not counted (like
        torch's HashStore and TCPStore): one Txn of count-only ranges."""
        try:
            return self._etcd.queues.num_keys(self._scope() if self._scope else "")
        except CachedStoreError as exc:
            raise _translate(exc, "num_keys") from exc

    num_keys = getNumKeys

    def list_keys(self) -> list[str]:
        """Every key under the store's prefix, queue items left out: the keys
        :meth:`num_keys` counts (keys-only etcd ranges). Python callers only: torch's C++
        trampoline does not forward ``listKeys`` to Python stores."""
        try:
            return self._etcd.queues.list_keys(self._scope() if self._scope else "")
        except CachedStoreError as exc:
            raise _translate(exc, "list_keys") from exc

    def deleteKey(self, key: str) -> bool:  # noqa: N802 -- the name torch's C++ calls
        """Delete ``key``; True if it existed."""
        try:
            return self._etcd.delete(self._name(key))
        except CachedStoreError as exc:
            raise _translate(exc, f"delete_key {key!r}") from exc

    delete_key = deleteKey

    def append(self, key: str, value: bytes | str) -> None:
        """Atomically append ``value`` to the bytes under ``key`` (created if absent)."""
        try:
            self._etcd.append(self._name(key), value)
        except CachedStoreError as exc:
            raise _translate(exc, f"append {key!r}") from exc

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, blocking like :meth:`get` for absent ones. Cached keys
        cost nothing; the others are read together in as few Txns as etcd allows."""
        names = [self._name(k) for k in keys]
        return self._until_deadline(f"keys: {list(keys)!r}", self._wait_seconds(),
                                    lambda left: self._get_blocking(names, left))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Write each value under its key: one etcd Txn per 128 keys (``EtcdStore.mset``)."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        try:
            self._etcd.mset(zip([self._name(k) for k in keys], values, strict=True))
        except CachedStoreError as exc:
            raise _translate(exc, f"multi_set of {len(keys)} keys") from exc

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are implemented here."""
        return True

    # -- queues ------------------------------------------------------------------------------
    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the FIFO queue ``key`` (one Txn; see
        :mod:`cachedstore.queues`). Queue names do not collide with key names."""
        try:
            self._etcd.queues.push(self._name(key), value)
        except CachedStoreError as exc:
            raise _translate(exc, f"queue_push {key!r}") from exc

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest item of queue ``key``. ``block=True`` waits on the
        watch up to the store timeout (``DistStoreError`` "timeout"); ``block=False``
        raises ``QueueEmptyError`` at once on an empty queue. Each item is popped by
        exactly one caller across all processes. A pop whose delete may have reached etcd
        when the connection broke raises ``DistNetworkError`` (the item may be gone)."""
        name = self._name(key)
        wait = self._wait_seconds()
        try:
            return self._etcd.queues.pop(name, block, wait, clock=self._clock)
        except CachedStoreError as exc:
            raise _translate(exc, f"queue: {key!r}", wait) from exc

    def queue_len(self, key: str) -> int:
        """How many items queue ``key`` holds; 0 if it never existed (one count range)."""
        try:
            return self._etcd.queues.length(self._name(key))
        except CachedStoreError as exc:
            raise _translate(exc, f"queue_len {key!r}") from exc

    # -- clones and lifecycle ------------------------------------------------------------------
    def clone(self) -> TorchEtcdStore:
        """A store on the same etcd connection, cache and prefix, for use from another
        thread (torch's C++ clones stores for split and shrunk process groups). It lives
        until closed or until the store that owns the connection is closed."""
        if self._closed:
            raise dist.DistStoreError("TorchEtcdStore: clone of a closed store")
        shared = _Shared(self._etcd, owned=False, spec=self._shared.spec)
        return TorchEtcdStore._on(shared, self._store_timeout(), self._clock, self._scope)

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
        if spec is None or self._scope is not None:
            raise TypeError("a TorchEtcdStore built around an existing EtcdStore cannot be "
                            "pickled; build it from connection settings instead")
        if spec.get("_inline_password"):
            raise TypeError("a TorchEtcdStore given password= cannot be pickled (the pickle "
                            "would carry the password): give password_file= or set "
                            f"${PASSWORD_ENV} instead, in every process")
        spec = {k: v for k, v in spec.items() if k != "registry"}
        return (_rebuild, (spec, self._store_timeout().total_seconds()))


def _rebuild(spec: dict[str, Any], timeout: float) -> TorchEtcdStore:
    spec = dict(spec)
    return TorchEtcdStore(spec.pop("host"), spec.pop("port"), timeout=timeout, **spec)

