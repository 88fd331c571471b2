"""torch.distributed on etcd v3: a c10d ``Store`` and a torchrun rendezvous backend.

Two pieces, both on the cached :class:`~cachedstore.EtcdStore`, one module each:

* :mod:`cachedstore.torch.store` -- :class:`TorchEtcdStore`, a ``torch.distributed.Store``
  for ``init_process_group(store=...)``, ``PrefixStore`` and everything else taking a store.
* :mod:`cachedstore.torch.rendezvous` -- :class:`EtcdV3RendezvousBackend`, a backend for
  torch's ``DynamicRendezvousHandler``, and :func:`create_rdzv_handler`, registered under the
  ``torchrun.handlers`` entry point as ``etcd-v3``.

Import order matters here: torch's rendezvous package loads every ``torchrun.handlers``
entry point (``cachedstore.torch:create_rdzv_handler``) when it is first imported. So
:func:`create_rdzv_handler` is defined before :mod:`.rendezvous` (which imports torch's
rendezvous package) is imported: whichever side is imported first, the other finds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .store import DEFAULT_PREFIX, PASSWORD_ENV, TorchEtcdStore, read_password

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_RDZV_PREFIX",
    "PASSWORD_ENV",
    "EtcdV3RendezvousBackend",
    "TorchEtcdStore",
    "create_backend",
    "create_rdzv_handler",
    "read_password",
]


def create_rdzv_handler(params: RendezvousParameters | None = None) -> Any:
    """torchrun's ``etcd-v3`` rendezvous handler: a ``DynamicRendezvousHandler`` whose state
    lives in etcd v3 and whose store is a :class:`TorchEtcdStore` scoped to the run and to
    the rendezvous instance.

    ``--rdzv-endpoint``: ``host[:port]``, or several separated by commas (default port
    2379). ``--rdzv-id``: no ``/``. ``--rdzv-conf`` keys, besides torch's own
    (``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``,
    ``keep_alive_interval``, ...): ``cacert`` (CA bundle; enables TLS), ``cert`` and ``key``
    (client certificate), ``user`` (etcd auth; the password comes from
    ``$CACHEDSTORE_PASSWORD`` or ``password_file``, never from ``--rdzv-conf``),
    ``prefix`` (default ``/torch/elastic/v3/``), ``ttl`` (seconds an abandoned
    rendezvous outlives its last keep-alive, 3/4 × ttl to 1.5 × ttl; default 7200, at least
    4 × ``keep_alive_interval`` and ``keep_alive_interval`` × ``keep_alive_max_attempt``),
    ``store_timeout``
    (the store's timeout, default 300 s), ``request_timeout`` and ``connect_timeout``
    (seconds). Every time is checked: finite, > 0, bounded (``rendezvous.LIMITS``).
    torch's etcd-v2 names ``ca_cert``, ``ssl_cert``, ``ssl_cert_key`` and
    ``read_timeout`` are accepted too.

    Worker restarts: torch 2.13's agents by default keep one TCPStore, hosted by the rank-0
    agent, for the workers of every round, and a restarted gloo group then reads the
    previous round's peer addresses from it and fails (torch's own ``c10d`` backend fails
    the same way). Unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is set, or
    ``--rdzv-conf share_agent_store=1`` asks for torch's default, this handler therefore
    sets that variable to ``1`` in the agent process: each round's rank-0 worker hosts a
    fresh TCPStore, whose address the agents exchange through this etcd store.

    Called with ``params``, returns the handler. Called without arguments -- how torchrun
    loads a ``torchrun.handlers`` entry point (it registers ``entry_point.load()()``) --
    returns this function itself, the handler creator.
    """
    if params is None:
        return create_rdzv_handler
    from .rendezvous import create_handler_for

    return create_handler_for(params)


from .rendezvous import (  # noqa: E402 -- after create_rdzv_handler: see the docstring
    DEFAULT_RDZV_PREFIX,
    EtcdV3RendezvousBackend,
    create_backend,
)
