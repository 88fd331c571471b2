"""Property tests over names and values (hypothesis), against the real etcd fixture.

Every input either round-trips exactly -- through the writing store, through a second
store once its watch has applied the write, and through a raw etcd read of
``prefix + name`` -- or is refused with a typed error (InvalidTypeError, InvalidInputError)
and leaves etcd and the cache exactly as they were.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import etcd3
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cachedstore import (
    EtcdStore,
    InvalidInputError,
    InvalidTypeError,
    KeyNotFoundError,
    NotAnIntegerError,
    counters,
)
from cachedstore.server import LocalEtcd

pytestmark = pytest.mark.timeout(120)

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow])

# Text including lone surrogates: those in U+DC80..U+DCFF stand for undecodable bytes
# (surrogateescape) and are valid; the others cannot be encoded and must be refused.
any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=40)
names = st.one_of(
    st.text(min_size=1, max_size=40),
    any_text,
    st.binary(max_size=40),
    st.text(min_size=300, max_size=3000),  # long names
    st.sampled_from(["/", "//", "a/b/c", "\x00", "\xff", "é", "名前", "\U0001f600", " ",
                     "../x", "*", "\\"]),
)
values = st.one_of(st.binary(max_size=300), st.text(max_size=100), any_text,
                   st.just(b""), st.just(""), st.binary(min_size=10_000, max_size=50_000))


@pytest.fixture(scope="module")
def space(etcd: LocalEtcd) -> Iterator[dict[str, Any]]:
    """Two stores on one prefix, and a raw etcd3 client (module scope, for hypothesis)."""
    prefix = f"/t/properties-{uuid.uuid4().hex[:8]}/"
    host, port = etcd.endpoint.rsplit(":", 1)
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as writer, \
            EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as reader, \
            closing(etcd3.client(host, int(port))) as raw:
        yield {"prefix": prefix.encode(), "writer": writer, "reader": reader, "raw": raw}


def _encode(text: str | bytes) -> bytes:
    """What the store promises: bytes as is, str as UTF-8 (surrogateescape)."""
    return text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")


def _expected(name: str | bytes, value: str | bytes) -> tuple[bytes, bytes] | type[Exception]:
    """(etcd key suffix, stored bytes), or the error class the store must raise."""
    try:
        key, data = _encode(name), _encode(value)
    except UnicodeEncodeError:
        return InvalidInputError
    if not key or key.startswith((b"\xff\xff", b"\x00queue/")):  # empty, or reserved
        return InvalidInputError
    if data.startswith(counters.MARK):  # a counter's value: no one else may write one
        return InvalidInputError
    return key, data


def _raw_get(space: dict[str, Any], key: bytes) -> tuple[bytes | None, int]:
    value, meta = space["raw"].get(space["prefix"] + key)
    return value, (meta.mod_revision if meta is not None else 0)


def _unchanged(space: dict[str, Any], name: str | bytes, before: tuple[bytes | None, int]
               ) -> None:
    try:
        key = _encode(name)
    except UnicodeEncodeError:
        return  # no etcd key can correspond to it
    if key:
        assert _raw_get(space, key) == before


def _raw_before(space: dict[str, Any], name: str | bytes) -> tuple[bytes | None, int]:
    try:
        key = _encode(name)
    except UnicodeEncodeError:
        return None, 0
    return _raw_get(space, key) if key else (None, 0)


@PROPERTY_SETTINGS
@given(name=names, value=values)
@example(name="\ud800", value="v")  # a lone surrogate outside surrogateescape's range
@example(name="", value="v")
@example(name=b"", value=b"v")
@example(name="k", value="a\udfff")
@example(name="\udc80", value=b"\x80")  # surrogateescape: the same key as b"\x80"
@example(name=b"\xff\xfe\x00", value="\u00e9\U0001f600")
@example(name="x" * 3000, value=b"")
def test_set_then_get_round_trips_or_is_refused(space: dict[str, Any], name: str | bytes,
                                                value: str | bytes) -> None:
    writer, reader = space["writer"], space["reader"]
    expected = _expected(name, value)
    before = _raw_before(space, name)
    if not isinstance(expected, tuple):
        with pytest.raises(expected):
            writer.set(name, value)
        _unchanged(space, name, before)
        return
    key, data = expected
    writer.set(name, value)
    assert writer.get(name) == data
    assert writer.mget([name], default=None) == [data]
    assert writer.get(key) == data  # the bytes form of the name is the same key
    stored, revision = _raw_get(space, key)
    assert stored == data
    # A second store, once its watch has applied the write, agrees exactly.
    writer.wait([name], timeout=5)  # (present: returns at once)
    _wait_watch(reader, revision)
    assert reader.get(name) == data
    assert reader.get(key, None) == data


def _wait_watch(store: EtcdStore, revision: int) -> None:
    import time

    deadline = time.monotonic() + 10
    while store.watch_revision < revision:
        assert time.monotonic() < deadline, "the second store's watch did not catch up"
        time.sleep(0.002)


@PROPERTY_SETTINGS
@given(name=names, desired=values)
@example(name="\udbff", desired="v")
@example(name="k2", desired="\ud800")
@example(name=b"\x80", desired=b"")
@example(name=b"\xff\xff", desired=b"")  # reserved for counters: refused
@example(name="\x00queue/x", desired="v")  # reserved for queue items: refused
@example(name="0", desired=b"\x00cachedstore:counter\x00")  # a counter's marker: refused
def test_compare_set_and_delete_round_trip_or_are_refused(
        space: dict[str, Any], name: str | bytes, desired: str | bytes) -> None:
    writer = space["writer"]
    expected = _expected(name, desired)
    before = _raw_before(space, name)
    if not isinstance(expected, tuple):
        with pytest.raises(expected):
            writer.compare_set(name, "", desired)
        _unchanged(space, name, before)
        return
    key, data = expected
    writer.delete(name)
    assert writer.get(name, None) is None
    result = writer.compare_set(name, "", desired)
    assert result == data and writer.get(name) == data
    assert _raw_get(space, key)[0] == data
    assert writer.delete(key) is True  # via the bytes form
    assert writer.get(name, None) is None and _raw_get(space, key)[0] is None
    with pytest.raises(KeyNotFoundError):
        writer.get(name)


@settings(max_examples=40, deadline=None, database=None)
@given(bad=st.one_of(st.integers(), st.floats(), st.none(), st.lists(st.integers()),
                     st.dictionaries(st.text(), st.text()), st.booleans()))
def test_wrong_types_are_refused_with_typeerror(space: dict[str, Any], bad: object) -> None:
    writer = space["writer"]
    for call in (lambda: writer.get(bad), lambda: writer.set(bad, "v"),
                 lambda: writer.set("k", bad), lambda: writer.delete(bad),
                 lambda: writer.compare_set("k", bad, "v"), lambda: writer.add(bad)):
        with pytest.raises(InvalidTypeError) as info:
            call()
        assert isinstance(info.value, TypeError)
    assert _raw_get(space, b"k")[0] is None  # nothing half-written


def test_values_at_and_over_the_request_limit(space: dict[str, Any], etcd: LocalEtcd) -> None:
    """At the limit: round-trips; one byte over: InvalidInputError before anything is sent;
    over etcd's real limit with a store that believes otherwise: etcd's refusal becomes an
    InvalidInputError too. The old value survives every refusal."""
    writer, reader = space["writer"], space["reader"]
    key = b"big"
    full_key = space["prefix"] + key
    limit = writer.config.max_request_bytes - 512 - len(full_key)
    writer.set(key, "small")
    for size in (limit + 1, limit + 10_000):
        with pytest.raises(InvalidInputError):
            writer.set(key, b"x" * size)
        with pytest.raises(InvalidInputError):
            writer.compare_set(key, "small", b"x" * size)
        assert writer.get(key) == b"small" and _raw_get(space, key)[0] == b"small"
    at_limit = bytes(range(256)) * (limit // 256) + b"z" * (limit % 256)
    assert len(at_limit) == limit
    writer.set(key, at_limit)
    stored, revision = _raw_get(space, key)
    assert stored == at_limit and writer.get(key) == at_limit
    _wait_watch(reader, revision)
    assert reader.get(key) == at_limit
    with EtcdStore(endpoints=[etcd.endpoint], prefix=space["prefix"],
                   max_request_bytes=16 << 20) as lax:
        for size in (1_600_000, 3_000_000):  # etcd's own check, then gRPC's message limit
            with pytest.raises(InvalidInputError):
                lax.set(key, b"y" * size)
            assert _raw_get(space, key)[0] == at_limit
        with pytest.raises(InvalidInputError):
            lax.get(b"n" * 3_000_000)  # a name over gRPC's limit: typed too
    assert writer.get(key) == at_limit


def test_add_on_bad_values(space: dict[str, Any]) -> None:
    writer = space["writer"]
    for junk in (b"", b"abc", b"1.5", b"\xff", b"1e3", "٣".encode()):
        writer.set("counter", junk)
        with pytest.raises(NotAnIntegerError):
            writer.add("counter", 1)
        assert writer.get("counter") == junk and _raw_get(space, b"counter")[0] == junk
    writer.set("counter", b" 41 ")  # int() accepts surrounding whitespace: documented below
    assert writer.add("counter", 1) == 42
    for amount in (1.0, "1", None, True):
        with pytest.raises(InvalidTypeError):
            writer.add("counter", amount)  # type: ignore[arg-type]
    assert writer.get("counter") == b"42"
