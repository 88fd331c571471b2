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
- ``heartbeats/<instance>/<addr>_<pid>_<local_id>`` (the address percent-encoded): JSON
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

__all__ = ["HEARTBEATS", "decode", "heartbeat_key", "heartbeat_value", "merge",
           "node_name", "parse_heartbeat", "runs", "structure"]

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
    """``<addr>_<pid>_<local_id>`` of a torch ``_NodeDesc``, ``addr`` percent-encoded."""
    return f"{quote(str(node.addr), safe='')}_{node.pid}_{node.local_id}"


def heartbeat_key(instance: str, node: Any) -> str:
    """The name (relative to the run's prefix) of ``node``'s heartbeat key."""
    return f"{HEARTBEATS}{instance}/{node_name(node)}"


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


def runs(dropped: Iterable[str], survivors: Iterable[str]) -> list[tuple[str, str]]:
    """The node names of ``dropped`` as few ranges ``(first, last)`` (both included, in
    etcd's key order) as cover them without covering a name of ``survivors``: a guard
    "no key in these ranges changed" over the dropped nodes that no surviving node's
    keep-alive can make fail. Nodes of one host (one address) sort together, so a host
    that died is one range."""
    alive = set(survivors)
    gone = set(dropped) - alive  # a name in both is a survivor's: never covered
    order = sorted(gone | alive, key=str.encode)
    found: list[tuple[str, str]] = []
    first: str | None = None
    last = ""
    for name in order:
        if name in gone:
            if first is None:
                first = name
            last = name
        elif first is not None:
            found.append((first, last))
            first = None
    if first is not None:
        found.append((first, last))
    return found
