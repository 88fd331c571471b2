"""Counters without contention: how ``add`` lays a counter out in etcd, and reads it back.

A compare-and-swap loop on one key costs up to W²/2 Txns (each a raft proposal) for W
concurrent ``add``s, and every retry is an event that every watching store receives. So a
counter is split in two:

- the key itself, ``<prefix><name>``, holds a *marker*: :data:`MARK` followed by the
  counter's decimal *base*. It is written when the counter is created (or converted from a
  plain decimal value), not by the ``add``s that follow, so the stores watching the prefix
  see one event per counter, not one per ``add``;
- the increments live under ``<prefix> FF FF "counter/" <name, percent-encoded> "/"``, past
  the end of the range every store watches (see ``keys.py``): ``ones``, a key put once per
  ``add(name, 1)`` (etcd raises a key's ``version`` by exactly one per put, so its version
  counts them), and ``delta/<random>``, one key per ``add(name, n)`` with any other ``n``,
  holding ``n`` in decimal.

The value is ``base + version(ones) + sum(deltas)``. Every ``add(name, n != 0)`` is one Txn
with no compare that can be lost to another ``add``: "the key holds a marker" (two value
compares bracketing :data:`MARK`, whatever the base) → put the increment and read back what
the sum needs, all at the Txn's revision; else, in a nested Txn, "the key is absent" →
create it with base ``n`` (and clear any parts left by an earlier life of the counter).
Both branches are one raft proposal; each ``add`` returns a distinct value, and the values
of W concurrent ``add(k, 1)`` are 1..W. Only a key holding a plain value that someone
``set`` needs a compare-and-swap to convert it (:func:`convert_request`), once.
``add(name, 0)`` is a read-only Txn: no proposal, no revision, no event.

Upkeep: an ``add`` that read :data:`COMPACT_AT` deltas folds them into the base
(:func:`compact_request`); ``append``, ``compare_set`` and ``read`` turn a counter back into
a plain decimal first (:func:`fold_request`); names over 200 bytes are named in the parts'
keys by a digest behind ``%%`` (which no percent-encoded name contains: the parts of two
names never coincide), so that an ``add`` or ``delete`` never carries a name three times
over.

What a plain etcd client sees: the key holds ``"\\x00cachedstore:counter\\x00<base>"``; the
parts are listed above. ``get`` through a store returns the decimal value.

This module builds requests and decodes answers; it does no I/O (``writes.py`` and
``reads.py`` send them).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from . import etcdapi
from .errors import NotAnIntegerError
from .keys import KeySpace, prefix_range_end

__all__ = [
    "COMPACT_AT",
    "DIGEST_ESCAPE",
    "MARK",
    "CounterMark",
    "Parts",
    "add_request",
    "add_result",
    "base_of",
    "clear",
    "compact_request",
    "convert_request",
    "create_request",
    "fold_request",
    "is_mark",
    "mark",
    "parse_int",
    "read_ops",
    "stored",
    "value_of",
]

#: Names longer than this (bytes) are identified in the parts' keys by a digest.
_LONG_NAME = 200
#: What precedes a digest in the parts' keys: no percent-encoded name contains it.
DIGEST_ESCAPE = b"%%"
#: An add that read this many delta keys folds them into the base (``compact_request``).
COMPACT_AT = 64
#: Every counter's key holds a value starting with these bytes.
MARK = b"\x00cachedstore:counter\x00"
_MARK_END = MARK[:-1] + b"\x01"  # the first value past every marker


class CounterMark(bytes):
    """A counter's marker as the cache holds it: a ``bytes`` of another class, so that the
    hit path's one type check (``value.__class__ is bytes``) sends it to the slow path,
    which reads the counter's value."""

    __slots__ = ()


def is_mark(value: bytes | None) -> bool:
    return value is not None and value.startswith(MARK)


def stored(value: bytes | None) -> bytes | None:
    """``value`` as the cache keeps it: a marker becomes a :class:`CounterMark`."""
    if value is not None and value.__class__ is bytes and value.startswith(MARK):
        return CounterMark(value)
    return value


def mark(base: int) -> bytes:
    return MARK + str(base).encode()


def base_of(marker: bytes) -> int:
    try:
        return int(marker[len(MARK):] or b"0")
    except ValueError:
        raise NotAnIntegerError(f"a counter's marker with no decimal base: "
                                f"{marker[:60]!r}") from None


class Parts:
    """The etcd keys of one counter's increments."""

    __slots__ = ("key", "ones", "deltas", "deltas_end", "start", "end")

    def __init__(self, keys: KeySpace, canonical: str) -> None:
        self.key = keys.key(canonical)
        raw = canonical.encode("utf-8", "surrogateescape")
        # Long names by digest: a percent-encoded name is up to 3 times as long, and the
        # parts' range travels in every add and delete.
        # Injective over every name: percent-encoding is reversible and never puts two
        # '%' in a row (each is followed by two hex digits), so a digest behind '%%' is
        # no short name's encoding ('~', the old escape, is left alone by quote: the name
        # "~<digest>" spelled a long name's parts).
        encoded = quote(raw, safe="").encode() if len(raw) <= _LONG_NAME \
            else DIGEST_ESCAPE + hashlib.blake2b(raw, digest_size=20).hexdigest().encode()
        self.start = keys.internal + b"counter/" + encoded + b"/"
        self.end = prefix_range_end(self.start)
        self.ones = self.start + b"ones"
        self.deltas = self.start + b"delta/"
        self.deltas_end = prefix_range_end(self.deltas)


def clear(p: Parts) -> Any:
    """An operation deleting every part of the counter (not its key)."""
    return etcdapi.op_delete(etcdapi.delete(p.start, range_end=p.end))


def read_ops(p: Parts) -> list[Any]:
    """Ranges that read a counter whole: its key, its ``ones``, its deltas."""
    return [etcdapi.op_range(etcdapi.range_key(p.key)),
            etcdapi.op_range(etcdapi.range_key(p.ones)),
            etcdapi.op_range(etcdapi.range_prefix(p.deltas, p.deltas_end))]


def add_request(p: Parts, amount: int) -> Any:
    """The one Txn of ``add(name, amount)``, ``amount != 0`` (see the module docstring).
    Its answer goes to :func:`add_result`."""
    if amount == 1:
        increment = etcdapi.op_put(etcdapi.put(p.ones, b"", prev_kv=True))
    else:
        delta_key = p.deltas + os.urandom(8).hex().encode()
        increment = etcdapi.op_put(etcdapi.put(delta_key, str(amount).encode()))
    create = etcdapi.txn(
        [etcdapi.never_put(p.key)],
        [etcdapi.op_put(etcdapi.put(p.key, mark(amount))), clear(p)],
        [etcdapi.op_range(etcdapi.range_key(p.key))])
    holds_marker = etcdapi.value_between(p.key, MARK, _MARK_END)
    return etcdapi.txn(holds_marker, [increment, *read_ops(p)], [etcdapi.op_txn(create)])


def add_result(response: Any, amount: int) -> tuple[str, int | Any]:
    """What an :func:`add_request` did: ``("added", value)``, ``("created", amount)``, or
    ``("plain", kv)``: the key holds a plain value (``kv``), to be converted."""
    if response.succeeded:
        responses = response.responses
        value = _sum(responses[1].response_range.kvs, responses[2].response_range.kvs,
                     responses[3].response_range.kvs)
        return "added", value  # the ranges ran after the put: it is counted
    nested = response.responses[0].response_txn
    if nested.succeeded:
        return "created", amount
    return "plain", nested.responses[0].response_range.kvs[0]


def create_request(p: Parts) -> Any:
    """A Txn creating the counter with base 0 if its key was never put (and clearing any
    parts left by an earlier life of the counter), else reading it whole (the answers of
    :func:`read_ops`, for :func:`value_of`)."""
    return etcdapi.txn([etcdapi.never_put(p.key)],
                       [etcdapi.op_put(etcdapi.put(p.key, mark(0))), clear(p)],
                       read_ops(p))


def compact_request(p: Parts, answers: Sequence[Any], max_txn_ops: int) -> Any | None:
    """A Txn folding what an add's success branch read (``answers``: its put, then the
    ranges of :func:`read_ops`) into the key's base: the key gets the counter's value as
    its new base, ``ones`` and the deltas read are deleted. It fails if the key or ``ones``
    changed since; deltas added meanwhile have other names and stay. None if there is
    nothing to fold. Within ``max_txn_ops`` operations per branch (etcd's
    ``--max-txn-ops``, as the store is configured): the put, the delete of ``ones`` and
    up to ``max_txn_ops - 2`` deltas; the rest wait for the next fold."""
    key_kvs = answers[1].response_range.kvs
    ones_kvs = answers[2].response_range.kvs
    deltas = list(answers[3].response_range.kvs)[:max(0, max_txn_ops - 2)]
    if not key_kvs or not key_kvs[0].value.startswith(MARK) or not deltas:
        return None
    base = base_of(key_kvs[0].value) + (ones_kvs[0].version if ones_kvs else 0) \
        + sum(int(kv.value) for kv in deltas)
    compares = [etcdapi.unmodified(p.key, key_kvs[0].mod_revision),
                etcdapi.unmodified(p.ones, ones_kvs[0].mod_revision) if ones_kvs
                else etcdapi.never_put(p.ones)]
    success = [etcdapi.op_put(etcdapi.put(p.key, mark(base)))]
    if ones_kvs:
        success.append(etcdapi.op_delete(etcdapi.delete(p.ones)))
    success += [etcdapi.op_delete(etcdapi.delete(kv.key)) for kv in deltas]
    return etcdapi.txn(compares, success)


def convert_request(p: Parts, kv: Any, value: int) -> Any:
    """A compare-and-swap turning a key that holds a plain value (as read: ``kv``) into a
    counter of ``value``, clearing parts left over from an earlier life. It fails if the
    key changed since it was read."""
    return etcdapi.txn([etcdapi.unmodified(p.key, kv.mod_revision)],
                       [etcdapi.op_put(etcdapi.put(p.key, mark(value))), clear(p)])


def fold_request(p: Parts, key_kv: Any, value: int, revision: int) -> Any:
    """A Txn turning a counter read at ``revision`` (its key's kv: ``key_kv``, its value:
    ``value``) back into a plain decimal key, for ``append`` and ``compare_set``. Fails if
    the key or any part changed since the read."""
    compares = [etcdapi.unmodified(p.key, key_kv.mod_revision),
                etcdapi.unmodified_since(p.start, p.end, revision)]
    return etcdapi.txn(compares, [etcdapi.op_put(etcdapi.put(p.key, str(value).encode())),
                                  clear(p)])


def _sum(key_kvs: Sequence[Any], ones_kvs: Sequence[Any], delta_kvs: Sequence[Any]
         ) -> int | Any:
    """A counter's value from the three ranges of :func:`read_ops`; if its key holds no
    marker, that key's kv (or None if absent) instead."""
    if not key_kvs or not key_kvs[0].value.startswith(MARK):
        return key_kvs[0] if key_kvs else None
    total = base_of(key_kvs[0].value)
    if ones_kvs:
        total += ones_kvs[0].version
    for kv in delta_kvs:
        total += int(kv.value)
    return total


def value_of(responses: Sequence[Any]) -> int | Any:
    """Decode the answers to :func:`read_ops` (three range responses): the counter's value,
    or the key's kv (None if absent) when it holds no marker."""
    return _sum(responses[0].response_range.kvs, responses[1].response_range.kvs,
                responses[2].response_range.kvs)


def parse_int(value: bytes, name: object) -> int:
    """A plain value as the integer ``add`` counts from; NotAnIntegerError if it is not
    a decimal integer."""
    try:
        return int(value)
    except ValueError:
        raise NotAnIntegerError(
            f"add() on key {name!r}: its value {value[:40]!r} is not a decimal integer"
        ) from None
