"""A history of store operations, and the checker of cachedstore's promises over it.

Plain code, independent of how the history was made (the simulation in this directory,
or a run against real etcd): the input is a list of :class:`Record` (or dicts with the same
fields) and etcd's change log. Nothing here knows the harness.

Inputs
------
``changes``: every change etcd made, in order: ``(mod_revision, key, value or None for a
delete)`` (full etcd keys, bytes; several changes may share a revision: one Txn).

``records``: one :class:`Record` per operation:

- ``store``: which store ran it (any hashable); ``op``: what it did (below);
- ``names``: the canonical names it concerned (queue names for queue operations);
- ``args``: ``value`` (set, queue_push), ``expected``/``desired`` (compare_set),
  ``amount`` (add);
- ``bounds``: per name, the revision a read begun then must be no older than: what the
  store's watch had applied for the scope covering the name (or the creation revision it
  was replaying up to); etcd's revision when the store was not serving its cache. For
  ``torch_check`` also ``"queue:" + name``: the same for the queue's items;
- ``invoked``/``returned``: positions in one global order of invocations and returns
  (``returned`` None: the operation never returned);
- ``inv_rev``/``ret_rev``: etcd's revision when it was invoked / returned (``ret_rev``
  None: unknown, the newest revision is used);
- ``result``, ``error`` (the exception's class name, or None), ``revision`` (the header
  revision of a write's answer, if known);
- ``quiescent``: a read made after every watch delivered everything (convergence): it
  must return etcd's state at ``ret_rev`` exactly.

Operations and what their result means: ``get``/``aget``/``blocking_get`` (bytes or None
for absent), ``mget`` (a list of them), ``wait`` (None: every name exists), ``check``
(True: every key exists), ``torch_check`` (True: every name exists as a key or a non-empty
queue), ``set``, ``delete``, ``compare_set`` (torch's rule: the new value, or the current
one, or ``expected`` when absent), ``add`` (the counter's new value), ``queue_push``,
``queue_pop`` (the item), ``queue_len`` (the count).

Checks
------
Values written by ``set``/``compare_set`` are unique, so each value read maps to the
revisions at which etcd held it. Per store and name, in the order operations returned:

- coherence: a read returns a state etcd held at some revision ≥ its bound, and not
  newer than etcd's revision when it returned;
- monotonic reads and read-your-writes: reads and acknowledged writes of one store and
  name are placed at non-decreasing revisions (a read invoked after another returned, or
  after a write returned, is placed no earlier);
- convergence: a quiescent read returns etcd's state exactly;
- blocking reads wake: an operation that never returned must be waiting for a name that
  does not exist in etcd's final state; and none ends with "absent" (KeyNotFoundError)
  before its timeout;
- counters: each counter's final value is the sum of its acknowledged adds, plus at most
  the adds whose outcome is unknown (``EtcdConnectionError``); an add that raised anything
  else must not have been applied; no two adds return the same value;
- queues: every item popped was pushed and is popped once; an item deleted from etcd was
  popped by someone, or by a pop whose outcome is unknown; ``queue_len``, an empty
  non-blocking pop and ``torch_check`` agree with etcd at some revision in their window.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachedstore.queues import item_prefix

__all__ = ["Etcd", "Record", "check_history"]

#: Errors that say "the outcome is unknown" (the write may or may not have been applied).
UNKNOWN = frozenset({"EtcdConnectionError", "ClusterMismatchError"})
READS = frozenset({"get", "aget", "blocking_get", "mget"})
BLOCKING = frozenset({"blocking_get", "wait"})


@dataclass
class Record:
    store: Any
    op: str
    names: list[str]
    args: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, int] = field(default_factory=dict)
    invoked: int = 0
    returned: int | None = None
    inv_rev: int = 0
    ret_rev: int | None = None
    result: Any = None
    error: str | None = None
    revision: int | None = None
    quiescent: bool = False

    def describe(self) -> str:
        what = f"{self.op}({', '.join(map(repr, self.names))}"
        if self.args:
            what += ", " + ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        outcome = f"raised {self.error}" if self.error else f"-> {self.result!r}"
        return (f"#{self.invoked}..{self.returned} store {self.store}: {what}) {outcome} "
                f"[bounds {self.bounds}, revisions {self.inv_rev}..{self.ret_rev}]")


class Etcd:
    """etcd's states over time, from its change log."""

    def __init__(self, changes: Iterable[tuple[int, bytes, bytes | None]],
                 prefix: bytes = b"") -> None:
        self.prefix = prefix
        self.by_key: dict[bytes, tuple[list[int], list[bytes | None]]] = defaultdict(
            lambda: ([], []))
        self.last = 0
        for revision, key, value in changes:
            revs, values = self.by_key[bytes(key)]
            revs.append(int(revision))
            values.append(None if value is None else bytes(value))
            self.last = max(self.last, int(revision))

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode("utf-8", "surrogateescape")

    def value_at(self, key: bytes, revision: int) -> bytes | None:
        revs, values = self.by_key.get(key, ([], []))
        i = bisect.bisect_right(revs, revision)
        return values[i - 1] if i else None

    def first_at(self, key: bytes, value: bytes | None, low: int, high: int) -> int | None:
        """The first revision in ``[low, high]`` at which ``key`` held ``value``."""
        if low > high:
            return None
        if self.value_at(key, low) == value:
            return low
        revs, values = self.by_key.get(key, ([], []))
        for i in range(bisect.bisect_right(revs, low), len(revs)):
            if revs[i] > high:
                break
            if values[i] == value and (i + 1 == len(revs) or revs[i + 1] != revs[i]):
                return revs[i]
        return None

    def written_at(self, key: bytes, value: bytes) -> int | None:
        revs, values = self.by_key.get(key, ([], []))
        for rev, held in zip(revs, values, strict=True):
            if held == value:
                return rev
        return None

    def items(self, queue: str, revision: int) -> dict[bytes, bytes]:
        """The items of queue ``queue`` at ``revision``: key → value."""
        start = self.key(item_prefix(queue))
        out = {}
        for key in self.by_key:
            if key.startswith(start):
                value = self.value_at(key, revision)
                if value is not None:
                    out[key] = value
        return out

    def exists(self, name: str, revision: int) -> bool:
        return self.value_at(self.key(name), revision) is not None


def _window(etcd: Etcd, low: int, high: int | None) -> range:
    return range(low, (etcd.last if high is None else high) + 1)


def check_history(records: Sequence[Record | Mapping[str, Any]],
                  changes: Iterable[tuple[int, bytes, bytes | None]], *,
                  prefix: bytes = b"", counters: Iterable[str] = (),
                  final_counters: Mapping[str, int] | None = None,
                  quiescent: bool = False, deleted_counters: Iterable[str] = ()
                  ) -> list[str]:
    """Every violation of the promises in ``records`` (empty: none). ``counters``: the
    names used as counters (their reads are not value-checked); ``final_counters``: their
    values read linearizably at the end; ``quiescent``: the history ends after every watch
    delivered everything (operations still blocked must be waiting for absent names);
    ``deleted_counters``: counters that other clients delete (their adds start over: only
    the blocking-read and key checks that do not read values apply)."""
    recs = [r if isinstance(r, Record) else Record(**r) for r in records]
    etcd = Etcd(changes, prefix)
    counter_names = set(counters)
    found: list[str] = []
    _check_keys(recs, etcd, counter_names | set(deleted_counters), found)
    _check_counters(recs, counter_names, final_counters or {}, found)
    _check_queues(recs, etcd, found)
    for r in recs:
        # A blocking read ends with the key or with its timeout (StoreTimeoutError), never
        # with "absent": the simulation never lets a blocking read's timeout pass.
        if r.op in BLOCKING and r.error == "KeyNotFoundError":
            found.append(f"a blocking read gave up before its timeout: {r.describe()}")
    if quiescent:
        _check_wakes(recs, etcd, found)
    return found


def _check_keys(recs: list[Record], etcd: Etcd, counter_names: set[str],
                found: list[str]) -> None:
    placed: dict[tuple[Any, str], list[tuple[int, int]]] = defaultdict(list)
    done = sorted((r for r in recs if r.returned is not None), key=lambda r: r.returned or 0)
    for r in done:
        for i, name in enumerate(r.names):
            if name in counter_names or r.op.startswith("queue") or r.op == "add":
                continue
            history = placed[(r.store, name)]
            before = max((t for returned, t in history if returned < r.invoked), default=0)
            key = etcd.key(name)
            at = _place(r, i, name, key, before, etcd, found)
            if at is not None:
                history.append((r.returned or 0, at))


def _place(r: Record, i: int, name: str, key: bytes, before: int, etcd: Etcd,
           found: list[str]) -> int | None:
    """Check one name of one operation; return the revision it is placed at."""
    bound = r.bounds.get(name, 0)
    high = etcd.last if r.ret_rev is None else r.ret_rev
    if r.op in ("set", "delete") or (r.op == "compare_set" and r.error is None
                                      and r.result == r.args.get("desired")):
        if r.error is not None:
            return None
        if r.op == "delete":
            return r.revision  # the answer's header: etcd's revision after it
        revision = etcd.written_at(key, r.args["value" if r.op == "set" else "desired"])
        if revision is None:
            found.append(f"acknowledged write not in etcd: {r.describe()}")
        return revision
    if r.error is not None:
        return None
    if r.op in READS or r.op == "compare_set":
        value = r.result[i] if r.op == "mget" else r.result
        if r.op == "compare_set" and value == r.args.get("expected"):
            value = None  # torch's rule: a failed compare_set of an absent key
        if r.quiescent:
            current = etcd.value_at(key, high)
            if value != current:
                found.append(f"convergence: {name!r} is {current!r} in etcd at {high}: "
                             f"{r.describe()}")
            return high
        low = max(bound, before)
        at = etcd.first_at(key, value, low, high)
        if at is None:
            if etcd.first_at(key, value, bound, high) is not None:
                what = "monotonic reads / read-your-writes"
            elif etcd.first_at(key, value, 0, high) is not None:
                what = "coherence (stale read)"
            else:
                what = "a value etcd never held"
            found.append(f"{what}: {name!r} read as {value!r}, which etcd did not hold at "
                         f"any revision in {low}..{high} (placed no earlier than {before} "
                         f"by this store's earlier operations): {r.describe()}")
        return at
    if r.op in ("wait", "check"):
        low = max(bound, before)
        want = True if r.op == "wait" else bool(r.result)
        if r.op == "check" and not want:
            return None  # one absent name is enough: checked below for all of them
        if not any(etcd.exists(name, t) for t in _window(etcd, low, high)):
            found.append(f"{r.op}: {name!r} did not exist at any revision in "
                         f"{low}..{high}: {r.describe()}")
        return None
    if r.op == "torch_check":
        if r.result:
            low_q = r.bounds.get("queue:" + name, bound)
            ok = any(etcd.exists(name, t) for t in _window(etcd, bound, high)) or any(
                etcd.items(name, t) for t in _window(etcd, low_q, high))
            if not ok:
                found.append(f"torch_check: {name!r} was neither a key nor a non-empty "
                             f"queue at any revision from its bounds to {high}: "
                             f"{r.describe()}")
        return None
    return None


def _check_counters(recs: list[Record], counter_names: set[str],
                    final: Mapping[str, int], found: list[str]) -> None:
    for name in sorted(counter_names):
        adds = [r for r in recs if r.op == "add" and r.names == [name]]
        acked = sum(r.args["amount"] for r in adds if r.error is None and r.returned)
        maybe = sum(r.args["amount"] for r in adds if r.error in UNKNOWN)
        refused = [r for r in adds if r.error is not None and r.error not in UNKNOWN]
        values = [r.result for r in adds if r.error is None and r.returned]
        if len(set(values)) != len(values):
            found.append(f"counter {name!r}: two adds returned the same value: "
                         f"{sorted(values)}")
        if name not in final:
            continue
        value = final[name]
        if not acked <= value <= acked + maybe:
            why = ""
            if value > acked + maybe and refused:
                why = (f"; {len(refused)} add(s) raised an error that says they were not "
                       f"applied: {refused[0].describe()}")
            found.append(f"counter {name!r} is {value}, acknowledged adds sum to {acked} "
                         f"(+{maybe} of unknown outcome){why}")


def _check_queues(recs: list[Record], etcd: Etcd, found: list[str]) -> None:
    queues = sorted({r.names[0] for r in recs if r.op.startswith("queue")})
    for queue in queues:
        ops = [r for r in recs if r.op.startswith("queue") and r.names == [queue]]
        pushed = {v for k, v in _all_items(etcd, queue)}
        popped: dict[bytes, Record] = {}
        unknown_pops = 0
        for r in ops:
            high = etcd.last if r.ret_rev is None else r.ret_rev
            if r.op == "queue_pop":
                if r.error in UNKNOWN:
                    unknown_pops += 1
                elif r.error is None and r.returned is not None:
                    if r.result in popped:
                        found.append(f"queue {queue!r}: item {r.result!r} popped twice: "
                                     f"{popped[r.result].describe()} and {r.describe()}")
                    popped[r.result] = r
                    if r.result not in pushed:
                        found.append(f"queue {queue!r}: popped an item never pushed: "
                                     f"{r.describe()}")
                elif r.error == "QueueEmptyError" and not any(
                        not etcd.items(queue, t) for t in _window(etcd, r.inv_rev, high)):
                    found.append(f"queue {queue!r} was never empty while a pop said "
                                 f"so: {r.describe()}")
            elif r.op == "queue_len" and r.error is None and r.returned is not None \
                    and not any(len(etcd.items(queue, t)) == r.result
                                for t in _window(etcd, r.inv_rev, high)):
                found.append(f"queue {queue!r}: queue_len {r.result} matches no "
                             f"revision of its window: {r.describe()}")
        remaining = set(etcd.items(queue, etcd.last).values())
        taken = pushed - remaining
        lost = taken - set(popped)
        if len(lost) > unknown_pops:
            found.append(f"queue {queue!r}: {len(lost)} item(s) left etcd but no pop "
                         f"returned them ({unknown_pops} pop(s) of unknown outcome): "
                         f"{sorted(lost)[:5]}")
    _check_torch_absent(recs, etcd, found)


def _all_items(etcd: Etcd, queue: str) -> list[tuple[bytes, bytes]]:
    start = etcd.key(item_prefix(queue))
    out = []
    for key, (_, values) in etcd.by_key.items():
        if key.startswith(start):
            out += [(key, v) for v in values if v is not None]
    return out


def _check_torch_absent(recs: list[Record], etcd: Etcd, found: list[str]) -> None:
    """A ``check`` (or ``torch_check``) that said False: some name was absent (and, for
    torch, its queue empty) at some revision no older than its bounds."""
    for r in recs:
        if r.op not in ("check", "torch_check") or r.error is not None or r.result \
                or r.returned is None:
            continue
        high = etcd.last if r.ret_rev is None else r.ret_rev
        ok = False
        for name in r.names:
            bound = r.bounds.get(name, 0)
            absent = [t for t in _window(etcd, bound, high) if not etcd.exists(name, t)]
            if not absent:
                continue
            if r.op == "check":
                ok = True
                break
            low_q = r.bounds.get("queue:" + name, bound)
            if any(not etcd.items(name, t) for t in _window(etcd, low_q, high)):
                ok = True
                break
        if not ok:
            found.append(f"{r.op} said False, but every name existed (as a key or a "
                         f"non-empty queue) at every revision from its bounds on: "
                         f"{r.describe()}")


def _check_wakes(recs: list[Record], etcd: Etcd, found: list[str]) -> None:
    for r in recs:
        if r.returned is None and r.op in BLOCKING \
                and all(etcd.exists(name, etcd.last) for name in r.names):
            found.append(f"a blocked read was never woken though every name it "
                         f"waits for exists: {r.describe()}")
