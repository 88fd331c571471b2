"""torch's rendezvous state as the etcd-v3 backend stores it: a state key and one heartbeat
key per node. Pure functions, no etcd.

torch's ``DynamicRendezvousHandler`` keeps one pickled ``_RendezvousState`` and writes it
back with a compare-and-swap whenever it changes, including each node's keep-alive, which
only moves ``last_heartbeats[node]``. With N agents keeping alive every 5 s, every
keep-alive races the others on one key: a lost race is a re-read and another Txn through
raft, so the cost per agent grows with N. The backend (``rendezvous.py``) therefore writes a
change that only moves heartbeat times as heartbeat keys, one per node, guarded only by the
state key's ``mod_revision`` (which such writes never change), and merges them back into
every state it hands to torch (:func:`merge`: the later time of the state's and the key's).

A *plain etcd client* sees, under the run's prefix:

- ``state``: the instance header and torch's pickled state; its ``last_heartbeats`` can be
  older than the keys';
- ``heartbeats/<instance>/<addr>_<pid>_<local_id>`` (the address percent-encoded, ``_``
  included): JSON
  ``{"node": {"addr": ..., "pid": ..., "local_id": ...}, "last_heartbeat": "<ISO 8601
  UTC>"}``, the node's newest keep-alive.

A state that does not unpickle to an object with a ``last_heartbeats`` dict (another torch
version, or bytes written by something else) is kept whole, as one compare-and-swap.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from datetime import datetime
from typing import Any
from urllib.parse import quote

__all__ = ["HEARTBEATS", "decode", "directory", "heartbeat_key", "heartbeat_value",
           "merge", "node_name", "parse_heartbeat", "runs", "structure"]

#: The directory of the heartbeat keys, relative to the run's prefix.
HEARTBEATS = "heartbeats/"


def decode(bits: bytes) -> Any | None:
    """torch's state unpickled, or None if ``bits`` are not a state this module
    understands. (torch itself unpickles the same bytes from etcd on every sync.)"""
    if not bits.startswith(b"\x80"):  # not a pickle of protocol 2 or later
        return None
    try:
        state = pickle.loads(bits)  # noqa: S301 -- the bytes torch would unpickle anyway
    except Exception:
        return None
    beats = getattr(state, "last_heartbeats", None)
    if not isinstance(beats, dict) or not hasattr(state, "__dict__"):
        return None
    if not all(isinstance(t, datetime) and t.tzinfo is not None for t in beats.values()):
        return None
    return state


def structure(state: Any) -> tuple[dict[str, Any], frozenset[Any]]:
    """Everything of ``state`` but its heartbeat times: equal structures mean a change
    moved heartbeat times only."""
    fields = {k: v for k, v in vars(state).items() if k != "last_heartbeats"}
    return fields, frozenset(state.last_heartbeats)


def node_name(node: Any) -> str:
    """``<addr>_<pid>_<local_id>`` of a torch ``_NodeDesc``, ``addr`` percent-encoded
    (``_`` too: the names of one address start with ``<addr>_`` and no other's do, so
    they sort together)."""
    addr = quote(str(node.addr), safe="").replace("_", "%5F")
    return f"{addr}_{node.pid}_{node.local_id}"


def directory(instance: str) -> str:
    """The name prefix (relative to the run's prefix) of ``instance``'s heartbeat keys."""
    return f"{HEARTBEATS}{instance}/"


def heartbeat_key(instance: str, node: Any) -> str:
    """The name (relative to the run's prefix) of ``node``'s heartbeat key."""
    return directory(instance) + node_name(node)


def heartbeat_value(node: Any, at: datetime) -> bytes:
    """The documented JSON value of a heartbeat key."""
    return json.dumps({"node": {"addr": str(node.addr), "pid": int(node.pid),
                                "local_id": int(node.local_id)},
                       "last_heartbeat": at.isoformat()}, sort_keys=True).encode()


def parse_heartbeat(value: bytes) -> datetime | None:
    """The time in a heartbeat key's value; None if it is not one (the key is ignored)."""
    try:
        at = datetime.fromisoformat(json.loads(value)["last_heartbeat"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    return at if at.tzinfo is not None else None


def merge(state: Any, beats: dict[str, datetime]) -> bool:
    """Move each of ``state``'s heartbeat times to the later of it and ``beats[node]``
    (``beats`` keyed by :func:`node_name`), in place; True if one moved. Nodes not in the
    state stay out: a key outliving its node's removal brings nothing back."""
    last = state.last_heartbeats
    moved = False
    for node, at in last.items():
        newer = beats.get(node_name(node))
        if newer is not None and newer > at:
            last[node] = newer
            moved = True
    return moved


def runs(dropped: Iterable[str], survivors: Iterable[str], limit: int
         ) -> list[tuple[str, str]]:
    """At most ``limit`` (≥ 1) ranges ``(first, last)`` of node names (both included, in
    etcd's key order) that cover every name of ``dropped``: one per run of dropped names
    between survivors, so that a guard "no key in these ranges changed" over the dropped
    nodes is not failed by a survivor's keep-alive. Nodes of one host sort together, so a
    host that died is one run. Past ``limit`` runs, neighbouring runs are joined across the
    gaps with the fewest survivors (those survivors are then covered too). A name in both
    is a survivor's."""
    alive = set(survivors)
    gone = set(dropped) - alive
    found: list[tuple[str, str]] = []
    gaps: list[int] = []  # survivors between found[i] and found[i + 1]
    first: str | None = None
    last = ""
    between = 0
    for name in sorted(gone | alive, key=str.encode):
        if name in gone:
            if first is None:
                if found:
                    gaps.append(between)
                first = name
            last = name
        else:
            if first is not None:
                found.append((first, last))
                first, between = None, 0
            between += 1
    if first is not None:
        found.append((first, last))
    if len(found) <= limit:
        return found
    joined = set(sorted(range(len(gaps)), key=gaps.__getitem__)[:len(found) - max(limit, 1)])
    merged = [found[0]]
    for i, (start, end) in enumerate(found[1:]):
        if i in joined:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
