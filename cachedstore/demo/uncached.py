"""The demo's contender: a careful etcd v3 client without a cache.

It is :class:`cachedstore.client.EtcdClient`, the plain client the CLI's one-shot commands
use too; this module adds what the demo says about it.
"""

from __future__ import annotations

from ..client import EtcdClient

__all__ = ["UNCACHED_MEANS", "UncachedClient"]

#: What "uncached" means, printed under the table and put in the JSON summary.
UNCACHED_MEANS = (
    "uncached = a bare etcd v3 client: every read is one etcd request (mget: one Txn of "
    "ranges); a blocking wait is a range plus one watch stream on the key while it is "
    "absent; add is one Txn (the store's counter layout). No polling."
)

#: The contender's class (the demo's name for it).
UncachedClient = EtcdClient
