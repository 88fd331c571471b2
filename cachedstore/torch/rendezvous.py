"""torchrun's ``etcd-v3`` rendezvous: a backend for torch's ``DynamicRendezvousHandler``.

Registered under the ``torchrun.handlers`` entry point as ``etcd-v3`` (see
:func:`cachedstore.torch.create_rdzv_handler`)::

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=etcd-v3 \\
             --rdzv-endpoint=etcd1:2379,etcd2:2379 --rdzv-id=job42 train.py

Keys of a run, under ``<prefix><run_id>/`` (one :class:`~cachedstore.EtcdStore` per agent):

- ``state``: torch's rendezvous state, behind a header naming the rendezvous *instance*
  (a random id drawn when the key is created). It sits on a lease and disappears
  ``3/4 × ttl`` to ``1.5 × ttl`` after the last keep-alive (keep-alives rewrite it before
  its lease runs out).
- ``heartbeats/<instance>/<node>``: each node's last keep-alive (JSON, see
  :mod:`cachedstore.torch.heartbeats`), on the same lease; merged into the state torch
  reads, so that keep-alives never race each other on ``state``.
- ``store/<instance>/...``: the keys of the store torch hands to the agents and workers.
  A rerun with the same ``--rdzv-id`` after the state expired creates a new instance, so
  it never reads the previous run's ``MASTER_ADDR``/``MASTER_PORT`` (etcd keeps the old
  instance's keys until someone deletes them: ``etcdctl del --prefix <prefix><run_id>/``).

The backend uses the store's public multi-key and lease components
(``store.versioned.read_many``/``put_many_if``, ``store.leases.grant``/``time_to_live``).
"""

from __future__ import annotations

import math
import os
import pickle
import secrets
import threading
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import CachedStoreError, EtcdConnectionError, LeaseNotFoundError
from ..store import EtcdStore, Snapshot, Versioned
from . import heartbeats
from .store import PASSWORD_ENV, TorchEtcdStore, _Shared, read_password

__all__ = [
    "DEFAULT_RDZV_PREFIX",
    "LIMITS",
    "EtcdV3RendezvousBackend",
    "create_backend",
    "create_handler_for",
]

#: Default key prefix of the rendezvous backend (``--rdzv-conf prefix=...`` overrides it).
DEFAULT_RDZV_PREFIX = "/torch/elastic/v3/"
#: The state key, relative to the run's prefix.
STATE = "state"
#: The header of the stored state: magic, the instance id (32 hex digits), a newline.
_MAGIC = b"cachedstore-rdzv/1 "
_HEADER = len(_MAGIC) + 32 + 1

#: ``--rdzv-conf`` keys in seconds: (default, largest accepted value).
LIMITS: dict[str, tuple[float | None, float]] = {
    "ttl": (7200.0, 30 * 24 * 3600.0),
    "store_timeout": (300.0, 30 * 24 * 3600.0),
    "request_timeout": (None, 3600.0),
    "read_timeout": (None, 3600.0),
    "connect_timeout": (None, 3600.0),
}
#: How many handed-out states (tokens) a backend remembers.
_VIEWS = 16
#: torch's default ``keep_alive_interval`` (seconds).
_KEEP_ALIVE_DEFAULT = 5.0
#: ``ttl`` must be at least this many keep-alive intervals (see ``_REWRITE``).
_KEEP_ALIVES_PER_TTL = 4
#: The leases a backend grants last ``_LEASE × ttl``; it takes a new one every ``ttl / 2``,
#: so a key it writes has at least ``ttl`` left.
_LEASE = 1.5
#: A keep-alive rewrites the state key once its lease has at most ``_REWRITE × ttl`` left:
#: at least ``ttl / 4`` after it was written. The next keep-alive after one that found
#: more left must land within ``3/4 × ttl``: ``ttl`` ≥ 4 keep-alive intervals leaves two
#: intervals for the keep-alives' own time.
_REWRITE = 0.75
#: How many lease expiries a backend remembers (its own and those it asked etcd for).
_LEASES = 32


def _encode(instance: str, state: bytes) -> bytes:
    return _MAGIC + instance.encode() + b"\n" + state


_HEX = frozenset(b"0123456789abcdef")


def _decode(value: bytes, key: bytes) -> tuple[str, bytes]:
    """(instance, torch's state) of the value stored under ``key``. A value without the
    header this backend writes (an instance id of 32 lowercase hex digits and a newline)
    was not written by it: torch's ``RendezvousStateError``, as torch's own backends raise
    for a state they cannot decode (``RendezvousBackend.get_state``'s contract). What
    follows the header is torch's, handed over unchanged."""
    instance = value[len(_MAGIC):_HEADER - 1]
    if not (value.startswith(_MAGIC) and len(value) >= _HEADER
            and value[_HEADER - 1:_HEADER] == b"\n" and _HEX.issuperset(instance)):
        raise RendezvousStateError(
            f"etcd-v3 rendezvous: the state object is corrupt: {key!r} holds "
            f"{bytes(value[:40])!r}, not a state this backend wrote (no "
            f"{_MAGIC.decode()}<instance> header)")
    return instance.decode("ascii"), value[_HEADER:]


#: ``put_many_if``'s ``unchanged_since``: name prefixes and name ranges → revision.
_Scopes = dict[str | bytes | tuple[str | bytes, str | bytes], int]


class _Leases:
    """The leases a backend attaches its keys to, and how long leases last.

    It grants a lease of ``1.5 × ttl`` and reuses it for ``ttl / 2``, so a key written with
    it has at least ``ttl`` left. It knows when its own leases expire (from when it asked
    for them) and learns it for another agent's lease from etcd (one LeaseTimeToLive per
    lease, remembering the last 32). Thread-safe."""

    def __init__(self, store: EtcdStore, ttl: float, clock: Clock) -> None:
        self._store = store
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._lease_id = 0
        self._renew_at = 0.0
        #: lease id → the clock's time by which it expires at the earliest
        self._expiries: dict[int, float] = {}

    def current(self) -> int:
        """The lease to attach keys to: granted anew every ``ttl / 2`` (one request).
        Raises RendezvousConnectionError when etcd cannot grant it."""
        with self._lock:
            now = self._clock.monotonic()
            if self._lease_id and now < self._renew_at:
                return self._lease_id
        granted = math.ceil(self._ttl * _LEASE)
        try:
            lease = self._store.leases.grant(granted)
        except CachedStoreError as exc:
            raise RendezvousConnectionError(
                f"etcd-v3 rendezvous: granting a lease failed: {exc}") from exc
        self._expire_at(lease, now + granted)  # asked at ``now``: it expires later
        with self._lock:
            self._lease_id = lease
            self._renew_at = now + self._ttl / 2
        return lease

    def forget(self, lease: int) -> None:
        """``lease`` vanished (expired or revoked): the next :meth:`current` grants one."""
        with self._lock:
            if self._lease_id == lease:
                self._lease_id = 0
            self._expiries.pop(lease, None)

    def expiring(self, lease: int) -> bool:
        """Whether a key on ``lease`` has at most ``_REWRITE × ttl`` left (0: no lease, it
        never expires). Another agent's lease costs one LeaseTimeToLive the first time;
        when etcd cannot say, the answer is yes: a rewrite costs a put, an expired state
        the run."""
        if not lease:
            return False
        with self._lock:
            expiry = self._expiries.get(lease)
        if expiry is None:
            asked = self._clock.monotonic()
            try:
                left = self._store.leases.time_to_live(lease)
            except CachedStoreError:
                return True
            if left is None:
                return True  # expired or revoked under us: put it back
            # etcd truncates the seconds left; counted from before the question: earliest
            expiry = asked + max(min(left), 0)
            self._expire_at(lease, expiry)
        return expiry - self._clock.monotonic() <= _REWRITE * self._ttl

    def _expire_at(self, lease: int, expiry: float) -> None:
        with self._lock:
            self._expiries[lease] = expiry
            while len(self._expiries) > _LEASES:
                del self._expiries[next(iter(self._expiries))]


class _View:
    """A state the backend handed torch, under the token it handed with it: the state key
    at ``token[0]`` merged with the run's heartbeat keys as of revision ``token[1]``."""

    __slots__ = ("instance", "token", "raw", "lease", "bits", "state", "beats", "beats_read")

    def __init__(self, instance: str, token: tuple[int, int], raw: bytes, lease: int,
                 bits: bytes, state: Any | None, beats: dict[str, int] | None) -> None:
        self.instance = instance
        self.token = token
        #: The state key's stored value, and the lease it is on (0: none).
        self.raw = raw
        self.lease = lease
        #: torch's bytes, heartbeat keys merged in (what torch got).
        self.bits = bits
        #: ``bits`` unpickled, None when the backend does not understand them (opaque).
        self.state = state
        #: node name → mod_revision of its heartbeat key at ``token[1]``.
        self.beats = beats or {}
        #: False when the heartbeat keys were not read (the instance kept changing under
        #: the reads): ``bits`` has the state key's times only, and a change that drops a
        #: node on the strength of them is refused (see ``set_state``).
        self.beats_read = beats is not None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A ``RendezvousBackend`` for torch's ``DynamicRendezvousHandler`` on etcd v3.

    The state lives in the key ``state`` of ``store`` (whose prefix is the run's,
    ``<prefix><run_id>/``), and each node's keep-alive time in a key of its own
    (``heartbeats/<instance>/<node>``, see :mod:`cachedstore.torch.heartbeats`), so that
    keep-alives do not race each other:

    - ``get_state`` is one read-only Txn: the state key and the heartbeat keys, merged
      (each node's later time).
    - ``set_state`` of a state that differs from the one handed out with ``token`` only in
      heartbeat times (a keep-alive) puts the changed nodes' heartbeat keys, if the state
      key is still at the token's ``mod_revision``: one Txn that no other keep-alive can
      make fail. Once the state key's lease has ``3/4 × ttl`` or less left, the keep-alive
      also rewrites the state key (with the merged times), on this backend's lease.
    - Any other change is a compare-and-swap of the state key on that ``mod_revision``,
      which also fails if a node the change drops (torch drops a node whose heartbeat is
      old) heartbeat since the token was read (guarded by key ranges that cover the
      dropped nodes' heartbeat keys and no surviving node's: one per dead host; past
      ``max_txn_ops - 1`` ranges, neighbours are joined across the fewest survivors), and
      which deletes the heartbeat keys of nodes the state no longer has.

    Either write returns the state read back in the same Txn, with a new token. A token is
    ``(state key's mod_revision, revision read at)``; one the backend did not hand out
    recently (it keeps the last 16) costs a read first. The keys are attached to a
    lease, so an abandoned rendezvous disappears: a node's heartbeat key ``ttl`` to
    ``1.5 × ttl`` after its last keep-alive, the state key ``3/4 × ttl`` to ``1.5 × ttl``
    after the last one (a backend reuses one lease of ``1.5 × ttl`` for ``ttl / 2``, so
    that a heartbeat every few seconds does not create a lease each time), while a
    rendezvous that some agent keeps alive at least every ``3/4 × ttl`` does not.
    ``ttl`` defaults to two hours, like torch's etcd backend (``create_backend`` requires
    at least 4 keep-alive intervals and torch's dead-node time).

    The stored state carries the rendezvous instance (see the module docstring);
    :attr:`instance` is the one of the state last read or written, the scope of the run's
    store.

    Args:
        store: the :class:`~cachedstore.EtcdStore` of the run (not closed here).
        run_id: the rendezvous id (``--rdzv-id``), for messages.
        ttl: seconds, finite and > 0; None means two hours.
        clock: times the lease renewal and the state key's rewrite.

    Raises ValueError for an empty ``run_id``, a bad ``ttl`` or a store whose
    ``max_txn_ops`` is below 3.

    Thread-safe (torch calls it from the agent's main thread and its keep-alive timer).
    Raises ``RendezvousConnectionError`` when etcd cannot be reached, and
    ``RendezvousStateError`` (``get_state`` and ``set_state``, as torch's own backends do)
    when the state key holds a value this backend did not write: no header, or a header
    whose instance is not 32 lowercase hex digits.
    """

    DEFAULT_TTL = 7200.0

    def __init__(self, store: EtcdStore, run_id: str, *, ttl: float | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if ttl is not None and not (0 < ttl < math.inf):
            raise ValueError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        if store.config.max_txn_ops < 3:
            raise ValueError(f"the store's max_txn_ops must be at least 3 (a guarded write "
                             f"and its read-back), got {store.config.max_txn_ops}")
        self._store = store
        self._run_id = run_id
        self._ttl = float(ttl) if ttl is not None else self.DEFAULT_TTL
        self._lock = threading.Lock()
        self._leases = _Leases(store, self._ttl, clock)
        self._instance: str | None = None
        self._views: dict[tuple[int, int], _View] = {}  # the last _VIEWS handed out

    @property
    def name(self) -> str:
        return "etcd-v3"

    @property
    def key(self) -> bytes:
        """The etcd key holding the rendezvous state."""
        return self._store.prefix + STATE.encode()

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def instance(self) -> str | None:
        """The rendezvous instance of the state last seen, or None before any."""
        return self._instance

    def store_scope(self) -> str:
        """The name prefix of the run's store keys: ``store/<instance>/``. Raises
        ``DistStoreError`` before the backend has seen a state (before a rendezvous)."""
        instance = self._instance
        if instance is None:
            raise dist.DistStoreError(
                f"etcd-v3 rendezvous {self._run_id!r}: the store is used before a rendezvous")
        return f"store/{instance}/"

    # -- reading ------------------------------------------------------------------------
    def _remember(self, found: Versioned, snap: Snapshot, beats_read: bool) -> _View:
        """The view of a snapshot holding the state key (and, if ``beats_read``, the
        heartbeat keys of its instance); kept for its token."""
        instance, bits = _decode(found.value, self.key)
        state = heartbeats.decode(bits)
        beats: dict[str, int] | None = {} if beats_read else None
        if state is not None and beats is not None:
            prefix = heartbeats.directory(instance)
            times = {}
            for name, versioned in snap.found.items():
                if name.startswith(prefix):
                    node = name[len(prefix):]
                    beats[node] = versioned.mod_revision
                    at = heartbeats.parse_heartbeat(versioned.value)
                    if at is not None:
                        times[node] = at
            if heartbeats.merge(state, times):
                bits = pickle.dumps(state)
        view = _View(instance, (found.mod_revision, snap.revision), bytes(found.value),
                     found.lease, bits, state, beats)
        with self._lock:
            self._instance = instance
            self._views[view.token] = view
            while len(self._views) > _VIEWS:
                del self._views[next(iter(self._views))]
        return view

    def _failed(self, doing: str, exc: Exception) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"etcd-v3 rendezvous: {doing} {self.key!r} failed: {exc}")

    def _read_view(self) -> _View | None:
        """The current state and heartbeat keys: one read-only Txn (two when the instance
        changed since the last one)."""
        guess = self._instance
        for attempt in range(3):
            prefixes = [heartbeats.directory(guess)] if guess is not None else []
            try:
                snap = self._store.versioned.read_many([STATE], prefixes)
            except CachedStoreError as exc:
                raise self._failed("reading", exc) from exc
            found = snap.found.get(STATE)
            if found is None:
                return None
            instance = _decode(found.value, self.key)[0]
            if instance == guess or attempt == 2:
                return self._remember(found, snap, beats_read=instance == guess)
            guess = instance
        raise AssertionError("unreachable")

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state (heartbeat keys merged) and its token, or None; one read-only Txn.
        RendezvousStateError if the state key holds a value this backend did not write."""
        view = self._read_view()
        return None if view is None else (view.bits, view.token)

    # -- writing ------------------------------------------------------------------------
    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored state is still the one handed out with ``token``
        (absent when None); return (state, token, True) on success, else the stored
        (state, token, False), or None if there is no state. One Txn (plus a lease grant
        every ``ttl / 2``). RendezvousStateError if the stored state it reads back (or
        reads, for a token it does not know) is not one this backend wrote; it is left
        as it is."""
        state = bytes(state)
        if token is None:
            instance = secrets.token_hex(16)  # a new rendezvous instance
            return self._write(instance, {STATE: 0}, {STATE: _encode(instance, state)}, [])
        if not (isinstance(token, tuple) and len(token) == 2
                and all(type(n) is int for n in token)):
            latest = self._read_view()  # not a token: answered as a stale one
            return None if latest is None else (latest.bits, latest.token, False)
        with self._lock:
            view = self._views.get(token)
        if view is None:  # not handed out here (recently): is it still current?
            view = self._read_view()
            if view is None:
                return None
            if view.token[0] != token[0]:
                return view.bits, view.token, False
        horizon = token[1]  # the revision the writer's view was read at
        limit = self._store.config.max_txn_ops
        expect: dict[str, int] = {STATE: view.token[0]}
        quiet: _Scopes = {}
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        old = view.state
        new = heartbeats.decode(state) if old is not None else None
        if new is not None and old is not None \
                and heartbeats.structure(new) == heartbeats.structure(old):
            # A keep-alive: only heartbeat times moved. Guarded by the state key alone.
            for node, at in new.last_heartbeats.items():
                if at > old.last_heartbeats[node]:
                    puts[heartbeats.heartbeat_key(view.instance, node)] = \
                        heartbeats.heartbeat_value(node, at)
            if len(puts) > limit - 3:  # not a keep-alive torch makes: write it whole
                puts = {STATE: _encode(view.instance, state)}
            elif puts and self._leases.expiring(view.lease):
                # Keep-alives leave the state key (and its lease) alone: rewrite it, with
                # the times merged in, on this backend's lease before the lease it is on
                # runs out.
                puts[STATE] = _encode(view.instance, state)
        else:
            puts[STATE] = _encode(view.instance, state)
            if new is not None and old is not None:
                directory = heartbeats.directory(view.instance)
                alive = {heartbeats.node_name(n) for n in new.last_heartbeats}
                dropped = {heartbeats.node_name(n) for n in old.last_heartbeats} - alive
                if dropped and not view.beats_read:
                    # Judged dead on the state key's times alone: not a decision to keep.
                    latest = self._read_view()
                    return None if latest is None else (latest.bits, latest.token, False)
                # The change fails if a node it drops (dead in the writer's view) heartbeat
                # after the writer read: no key changed since then in the ranges that cover
                # the dropped nodes' keys and as few surviving nodes' as fit the Txn (none
                # while there are fewer runs of dropped nodes than it compares).
                for first, last in heartbeats.runs(dropped, alive, limit - 1):
                    quiet[(directory + first, directory + last)] = horizon
                # Delete the keys of nodes the state no longer has (those dropped now,
                # and any left over), as many as the Txn takes.
                deletes = [directory + name for name in view.beats
                           if name not in alive][:(limit - 3) // 2]
        return self._write(view.instance, expect, puts, deletes, quiet)

    def _write(self, instance: str, expect: dict[str, int], puts: dict[str, bytes],
               deletes: list[str], quiet: _Scopes | None = None
               ) -> tuple[bytes, Token, bool] | None:
        """One guarded Txn, reading back the state and the heartbeat keys of
        ``instance``."""
        prefixes = [heartbeats.directory(instance)]
        for attempt in range(2):
            lease = self._leases.current() if puts else 0
            try:
                ok, snap = self._store.versioned.put_many_if(expect, puts, deletes, lease=lease,
                                                   names=[STATE], prefixes=prefixes,
                                                   unchanged_since=quiet)
            except LeaseNotFoundError:
                if attempt == 0:
                    self._leases.forget(lease)  # expired or revoked under us: take a new one
                    continue
                raise RendezvousStateError(
                    "etcd-v3 rendezvous: the state key's lease keeps vanishing") from None
            except EtcdConnectionError as exc:
                return self._after_unknown_outcome(expect, puts, exc)
            except CachedStoreError as exc:
                raise self._failed("writing", exc) from exc
            found = snap.found.get(STATE)
            if found is None:
                return None
            if _decode(found.value, self.key)[0] != instance:  # replaced by another instance
                view = self._read_view()
                return None if view is None else (view.bits, view.token, False)
            view = self._remember(found, snap, beats_read=True)
            return view.bits, view.token, ok
        raise RendezvousStateError("etcd-v3 rendezvous: the state key's lease keeps vanishing")

    def _after_unknown_outcome(self, expect: dict[str, int], puts: dict[str, bytes],
                               exc: Exception) -> tuple[bytes, Token, bool] | None:
        """The Txn may or may not have been applied: read the keys and decide. Heartbeat
        values carry microsecond times (and a new state its instance or torch's change), so
        equal bytes mean our write landed; a state key rewritten with a keep-alive landed if
        the heartbeat keys written in the same Txn did."""
        beats = {n: data for n, data in puts.items() if n != STATE}
        try:
            view = self._read_view()
            landed = self._store.versioned.read_many(list(beats)).found if beats else {}
        except (RendezvousConnectionError, CachedStoreError):
            raise self._failed("writing", exc) from exc
        if view is None:
            return None
        if beats:
            ok = all(n in landed and landed[n].value == data for n, data in beats.items())
        elif STATE in puts:
            ok = view.raw == puts[STATE] and view.token[0] != expect[STATE]
        else:
            ok = view.token[0] == expect[STATE]
        return view.bits, view.token, ok


# -- parameters ---------------------------------------------------------------------------
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
    """``--rdzv-conf name=...`` in seconds: finite, > 0 and at most ``LIMITS[name]``'s
    bound; its default if absent. ValueError naming the key otherwise."""
    default, upper = LIMITS[name]
    value = _conf(params, name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"--rdzv-conf {name}={value!r} is not a number of seconds") from None
    if not 0 < seconds <= upper:  # also refuses nan and inf
        raise ValueError(f"--rdzv-conf {name}={value!r}: must be a finite number of seconds "
                         f"> 0 and <= {upper:g}")
    return seconds


def _run_id(params: RendezvousParameters) -> str:
    run_id = params.run_id
    if not run_id or "/" in run_id or "\0" in run_id:
        raise ValueError(f"--rdzv-id {run_id!r}: must be non-empty, without '/' (it would "
                         f"nest inside another run's keys) or NUL")
    return run_id


def _keep_alive(params: RendezvousParameters) -> float:
    value = _conf(params, "keep_alive_interval")
    if value is None:
        return _KEEP_ALIVE_DEFAULT
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"--rdzv-conf keep_alive_interval={value!r} is not a number of "
                         f"seconds") from None


def _keep_alive_max_attempt(params: RendezvousParameters) -> int:
    value = _conf(params, "keep_alive_max_attempt")
    try:
        return 3 if value is None else int(value)  # torch's default
    except ValueError:
        raise ValueError(f"--rdzv-conf keep_alive_max_attempt={value!r} is not an "
                         f"integer") from None


def create_backend(params: RendezvousParameters
                   ) -> tuple[EtcdV3RendezvousBackend, TorchEtcdStore]:
    """The backend and the worker-facing store for ``params`` (see
    :func:`cachedstore.torch.create_rdzv_handler` for the ``--rdzv-conf`` keys). Validates
    every value first (ValueError naming the key), then connects to etcd (raises
    RendezvousConnectionError)."""
    run_id = _run_id(params)
    prefix = _conf(params, "prefix") or DEFAULT_RDZV_PREFIX
    if not prefix.endswith("/"):
        prefix += "/"
    cert = _conf(params, "cert", "ssl_cert")
    key = _conf(params, "key", "ssl_cert_key")
    if (cert is None) != (key is None):
        raise ValueError("--rdzv-conf: give both cert= and key=, or neither")
    if _conf(params, "password") is not None:
        raise ValueError(f"--rdzv-conf password= would be visible in ps and in torchrun's "
                         f"logs: set ${PASSWORD_ENV} or --rdzv-conf password_file=PATH")
    user = _conf(params, "user")
    password_file = _conf(params, "password_file")
    password = read_password(password_file) if user is not None else None
    if user is not None and password is None:
        raise ValueError(f"--rdzv-conf user={user!r} needs a password: set ${PASSWORD_ENV} "
                         f"or --rdzv-conf password_file=PATH")
    if user is None and password_file is not None:
        raise ValueError("--rdzv-conf password_file= needs user=")
    ttl = _conf_seconds(params, "ttl")
    assert ttl is not None
    keep_alive = _keep_alive(params)
    attempts = _keep_alive_max_attempt(params)
    least = max(_KEEP_ALIVES_PER_TTL * keep_alive, attempts * keep_alive)
    if ttl < least:
        raise ValueError(
            f"--rdzv-conf ttl={ttl:g} is below {least:g} s, the larger of "
            f"{_KEEP_ALIVES_PER_TTL} × keep_alive_interval ({keep_alive:g} s: a keep-alive "
            f"rewrites the state when 3/4 × ttl is left, the next must land in time) and "
            f"keep_alive_interval × keep_alive_max_attempt ({attempts}: torch's time before "
            f"it declares a node dead, which its heartbeat key must outlive)")
    store_timeout = _conf_seconds(params, "store_timeout")
    request_timeout = _conf_seconds(params, "request_timeout") or _conf_seconds(
        params, "read_timeout")
    connect_timeout = _conf_seconds(params, "connect_timeout")
    try:
        etcd = EtcdStore(
            endpoints=_endpoints(params.endpoint), prefix=f"{prefix}{run_id}/",
            ca_cert=_conf(params, "cacert", "ca_cert"), cert_cert=cert, cert_key=key,
            user=user, password=password, request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            # Like TorchEtcdStore: an agent receives the writes it reads (the rendezvous
            # state, its own store's keys), not the whole run's.
            watch_scope="touched")
    except CachedStoreError as exc:
        raise RendezvousConnectionError(
            f"etcd-v3 rendezvous: cannot connect to etcd at {params.endpoint!r}: {exc}"
        ) from exc
    backend = EtcdV3RendezvousBackend(etcd, run_id, ttl=ttl)
    store = TorchEtcdStore._on(_Shared(etcd, owned=True, spec=None), store_timeout or 300.0,
                               scope=backend.store_scope)
    return backend, store


def create_handler_for(params: RendezvousParameters) -> RendezvousHandler:
    """The ``DynamicRendezvousHandler`` of ``params`` (what torchrun's entry point returns;
    see :func:`cachedstore.torch.create_rdzv_handler`)."""
    if not params.get_as_bool("share_agent_store", False):
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    backend, store = create_backend(params)
    try:
        handler: RendezvousHandler = create_handler(store, backend, params)
    except BaseException:
        store.close()
        raise
    return handler

