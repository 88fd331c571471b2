"""``cachedstore demo``: a high-fan-out job run against etcd twice, cached and uncached.

``--workers`` processes play the ranks of a training job. Every round each of them

1. publishes its address (``set``),
2. reads every rank's address, blocking until all are present (``mget`` with a timeout),
3. takes part in a barrier (``add`` on a counter; the last rank sets a "done" key that
   everyone waits for with a blocking ``get``),
4. reads a shared config key ``--hot-reads`` times (the hot key).

The same workload runs twice, one phase after the other, under separate key prefixes:

* **cached** -- each worker uses an :class:`~cachedstore.EtcdStore`: reads come from its
  watch-fed cache, blocking waits are woken by its one watch stream;
* **uncached** -- each worker uses :class:`UncachedClient`, a bare etcd v3 client on the same
  connection layer: every read is one etcd request (``mget``: one Txn of ranges), a
  blocking wait is a range plus, while the key is absent, one watch stream on that key, and
  ``add`` is one Txn in the store's counter layout. That is what a careful client
  without a cache does; it does not poll.

The summary compares operations, hit ratio, latency percentiles and the etcd requests of
both phases: client side (unary RPCs plus watch streams opened, from each worker's
``cachedstore_etcd_requests_total``) and as counted by etcd itself
(``grpc_server_handled_total`` on its ``/metrics``).

etcd's count is read from the first endpoint's ``/metrics`` (plain HTTP only; with TLS it
is reported as unavailable). All workers talk to the first endpoint unless it fails, so on a
cluster that is the member that sees the traffic; on a shared cluster other clients' requests
are counted too.

Without ``endpoints`` a throw-away etcd (:class:`~cachedstore.server.LocalEtcd`) is started
and removed on exit, Ctrl-C included; with ``endpoints`` the keys live under a random
``/cachedstore-demo/<id>/`` prefix that is deleted at the end.

Worker processes are started with the ``spawn`` method (gRPC does not survive ``fork``) and
ignore SIGINT: the parent stops them. Each serves its metrics on ``metrics_port + rank`` when
``metrics_port`` is given (the one-port-per-process scheme of ``grafana/prometheus.yml``).

Modules, one concern each: :mod:`.settings` (:class:`DemoSettings`, :class:`DemoError`),
:mod:`.uncached` (the contender), :mod:`.workload` (the worker processes and their rounds),
:mod:`.figures` (counting and summing up), :mod:`.report` (progress bars and table) and
:mod:`.run` (etcd's lifecycle, the processes, clean-up).
"""

from .report import render_table
from .run import run_demo
from .settings import MODES, DemoError, DemoSettings
from .uncached import UNCACHED_MEANS, UncachedClient

__all__ = [
    "MODES",
    "UNCACHED_MEANS",
    "DemoError",
    "DemoSettings",
    "UncachedClient",
    "render_table",
    "run_demo",
]
