"""``cachedstore.keys``: names, etcd keys and values, and the reserved namespaces."""

from __future__ import annotations

import pytest

from cachedstore.errors import InvalidInputError, InvalidTypeError
from cachedstore.keys import KeySpace, int64, prefix_range_end, to_value


@pytest.fixture
def keys() -> KeySpace:
    return KeySpace("/job/", 1024)


@pytest.mark.parametrize("name, canonical", [
    ("a/b", "a/b"), (b"a/b", "a/b"), ("é", "é"), (b"\xff", "\udcff"),
    (bytearray(b"x"), "x"), (memoryview(b"y"), "y"),
])
def test_str_and_bytes_spell_one_name(keys: KeySpace, name: object, canonical: str) -> None:
    assert keys.canonical(name) == canonical
    key = keys.key(canonical)
    assert key.startswith(b"/job/") and keys.name_of(key) == canonical


@pytest.mark.parametrize("name, error, match", [
    ("", InvalidInputError, "empty"),
    ("\xff\xffcounter", None, None),  # U+00FF twice is a plain name: only bytes FF FF are
    (b"\xff\xffx", InvalidInputError, "counters"),
    (b"\x00queue/q/1", InvalidInputError, "queue"),
    (3, InvalidTypeError, "str or bytes"),
    ("\ud800", InvalidInputError, "UTF-8"),
])
def test_reserved_and_bad_names_are_refused(keys: KeySpace, name: object,
                                            error: type[Exception] | None,
                                            match: str | None) -> None:
    if error is None:
        assert keys.canonical(name)
        return
    with pytest.raises(error, match=match):
        keys.canonical(name)


def test_keys_outside_the_prefix_have_no_name_and_sizes_are_checked(keys: KeySpace) -> None:
    assert keys.name_of(b"/other/x") is None
    keys.check_size(keys.key("k"), b"v" * 100)
    with pytest.raises(InvalidInputError):
        keys.check_size(keys.key("k"), b"v" * 2048)


def test_values_ranges_and_revisions() -> None:
    assert to_value("é") == "é".encode() and to_value(b"\x00") == b"\x00"
    with pytest.raises(InvalidTypeError):
        to_value(1.5)
    assert prefix_range_end(b"a/") == b"a0" and prefix_range_end(b"a\xff") == b"b"
    assert int64(5, "rev") == 5
    for bad in (-1, True, 2**63, "1"):
        with pytest.raises((InvalidTypeError, InvalidInputError)):
            int64(bad, "rev")
