"""etcd leases of one store: grant, time to live, revoke (``store.leases``).

Keys written with a lease (``store.versioned.put_if(..., lease=...)``,
``put_many_if(..., lease=...)``) vanish when it expires or is revoked: torchrun's
rendezvous backend ties each agent's heartbeat to one. Every method is one request and
blocks for it; all are thread-safe and raise cachedstore errors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from . import etcdapi
from .config import seconds
from .connection import Connection
from .errors import EtcdError, InvalidInputError, LeaseNotFoundError
from .keys import int64

__all__ = ["Leases"]


class Leases:
    """The leases of one store's etcd cluster. ``check_open`` raises once it is closed."""

    def __init__(self, conn: Connection, check_open: Callable[[], None]) -> None:
        self._conn = conn
        self._check_open = check_open

    def grant(self, ttl: float) -> int:
        """A new etcd lease of ``ttl`` seconds (rounded up to whole seconds, at least 1);
        returns its id. InvalidInputError unless 0 < ttl < 2**62."""
        ttl_s = seconds(ttl, "ttl")
        if ttl_s is None or not 0 < ttl_s < 2**62:
            raise InvalidInputError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        self._check_open()
        response = self._conn.call("lease_grant", etcdapi.lease_grant(math.ceil(ttl_s)),
                                   deadline=self._conn.deadline())
        if response.error:
            raise EtcdError(f"etcd lease grant: {response.error}")
        return int(response.ID)

    def time_to_live(self, lease: int) -> tuple[int, int] | None:
        """``(seconds left, seconds granted)`` of ``lease``, or None if it expired, was
        revoked or never existed. InvalidTypeError unless ``lease`` is an int from 1 to
        2**63 - 1 (etcd's lease ids)."""
        int64(lease, "lease", least=1)
        self._check_open()
        response = self._conn.call("lease_time_to_live", etcdapi.lease_time_to_live(lease),
                                   deadline=self._conn.deadline())
        if response.TTL < 0:  # expired, revoked or never granted
            return None
        return int(response.TTL), int(response.grantedTTL)

    def revoke(self, lease: int) -> None:
        """Revoke ``lease``: every key attached to it is deleted. A lease that no longer
        exists is not an error. InvalidTypeError unless ``lease`` is an int from 1 to
        2**63 - 1."""
        int64(lease, "lease", least=1)
        self._check_open()
        try:
            self._conn.call("lease_revoke", etcdapi.lease_revoke(lease),
                            deadline=self._conn.deadline())
        except LeaseNotFoundError:
            pass
