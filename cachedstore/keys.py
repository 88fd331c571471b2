"""Names, values and prefixes: validation and the mapping between them and etcd keys.

A *name* is what the user passes (``str`` or ``bytes``), relative to the store's prefix. Its
*canonical* form, used as the cache key, is a ``str``: the etcd key's bytes decoded as UTF-8
with ``surrogateescape``, which maps every byte string to exactly one ``str`` and back. So
every spelling of a name that maps to the same etcd key (``b"\xc3\xa9"``, ``"é"`` and
``"\udcc3\udca9"``) has one cache entry, the one the watch invalidates. The cache holds only
canonical names, so a hit on a canonical ``str`` name allocates nothing; any other spelling
misses the hot path and is canonicalised on the slow path. The etcd key is
``prefix + canonical.encode("utf-8", "surrogateescape")``.

Keys under ``prefix + FF FF`` are the store's own (counters' parts, see ``counters.py``):
bytes FF never occur in UTF-8, so no ``str`` name without surrogate escapes reaches them,
names that would are refused, and the store's watch and listings stop short of them
(:attr:`KeySpace.range_end`), so that a counter's increments reach no other store.
"""

from __future__ import annotations

from .errors import InvalidInputError, InvalidTypeError

__all__ = ["KeySpace", "to_value"]

#: What follows the prefix in every internal key (never valid UTF-8).
INTERNAL = b"\xff\xff"
_INTERNAL_NAME = INTERNAL.decode("utf-8", "surrogateescape")
#: The directory of queue items (``queues.py``): reserved, like the internal keys.
QUEUE_DIRECTORY = "\x00queue/"
#: The first characters of reserved names (one test on the common path).
_RESERVED_FIRST = _INTERNAL_NAME[0] + QUEUE_DIRECTORY[0]

#: Room left in a request for everything but the key and value (gRPC and protobuf framing).
REQUEST_OVERHEAD = 512


def to_value(value: object, what: str = "value") -> bytes:
    """``value`` as bytes: ``bytes`` as is, ``str`` UTF-8 encoded, bytearray/memoryview copied.

    Raises ``InvalidTypeError`` (TypeError) for anything else.
    """
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        try:
            return value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(f"{what} is not encodable as UTF-8: {exc.reason}") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidTypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def int64(number: object, what: str, *, least: int = 0) -> int:
    """``number`` if it is an int from ``least`` to 2**63 - 1 (etcd's revisions and lease
    ids are int64), else InvalidTypeError naming ``what``."""
    if isinstance(number, bool) or not isinstance(number, int) \
            or not least <= number < 2**63:
        raise InvalidTypeError(f"{what} must be an int from {least} to 2**63 - 1, "
                               f"got {number!r}")
    return number


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that, with ``key=prefix``, covers every key under ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


class KeySpace:
    """Maps names to etcd keys under one prefix, and back. Immutable, thread-safe."""

    __slots__ = ("prefix", "range_start", "range_end", "full_range_end", "internal", "_plen",
                 "_max_request_bytes")

    def __init__(self, prefix: str | bytes, max_request_bytes: int) -> None:
        self.prefix = to_value(prefix, "prefix")
        self.range_start = self.prefix or b"\0"
        #: The end of the names' range ``[range_start, range_end)``: what the watch covers
        #: and listings count. The internal keys follow it.
        self.internal = self.prefix + INTERNAL
        self.range_end = self.internal
        #: The end of everything under the prefix, internal keys included.
        self.full_range_end = prefix_range_end(self.prefix)
        self._plen = len(self.prefix)
        self._max_request_bytes = max_request_bytes

    def canonical(self, name: object) -> str:
        """The cache key of ``name``; raises InvalidTypeError/InvalidInputError on bad input."""
        if type(name) is str:
            try:
                raw = name.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError as exc:
                raise InvalidInputError(
                    f"key name is not encodable as UTF-8: {exc.reason}") from None
            canonical = name if name.isascii() else raw.decode("utf-8", "surrogateescape")
        elif isinstance(name, (bytes, bytearray, memoryview)):
            canonical = bytes(name).decode("utf-8", "surrogateescape")
        else:
            raise InvalidTypeError(f"key name must be str or bytes, not {type(name).__name__}")
        if not canonical:
            raise InvalidInputError("key name must not be empty")
        if canonical[0] in _RESERVED_FIRST:
            if canonical.startswith(_INTERNAL_NAME):
                raise InvalidInputError(
                    "key names starting with bytes FF FF are reserved for the store's "
                    "counters")
            if canonical.startswith(QUEUE_DIRECTORY):
                raise InvalidInputError(
                    "key names starting with NUL 'queue/' are reserved for queue items")
        return canonical

    def key(self, canonical: str) -> bytes:
        """The etcd key of a canonical name."""
        try:
            return self.prefix + canonical.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"key name is not encodable as UTF-8: {exc.reason}") from None

    def name_of(self, key: bytes) -> str | None:
        """The canonical name of an etcd key, or None if it is not under the prefix."""
        if not key.startswith(self.prefix):
            return None
        return key[self._plen:].decode("utf-8", "surrogateescape")

    def check_size(self, key: bytes, value: bytes) -> None:
        """Raise InvalidInputError if a put of ``key``=``value`` exceeds etcd's request limit."""
        limit = self._max_request_bytes
        size = len(key) + len(value) + REQUEST_OVERHEAD
        if size > limit:
            raise InvalidInputError(
                f"key and value are {len(key) + len(value)} bytes; etcd accepts at most "
                f"{limit - REQUEST_OVERHEAD} (its --max-request-bytes is {limit}, less "
                f"{REQUEST_OVERHEAD} bytes of framing); set max_request_bytes if your "
                f"cluster allows more")
