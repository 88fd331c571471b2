"""The fan-out benchmark of issue 11: torch's coordination traffic at W simulated ranks.

Public API (what ``tests/test_fanout_counts.py`` and ``benchmarks/test_fanout_scale.py``
use)::

    from benchmarks.fanout import run_pattern
    r = run_pattern("store_barrier", 64, etcd.endpoint, etcd.metrics_url)
    r.counts.per_rank(64)       # etcd requests / proposals / watch messages per rank

Modules, one concern each: ``patterns`` (what a rank does, after torch's sources),
``recording`` (which keys a rank reads and writes; the deliveries it needs), ``worker``
(a block of ranks with their stores and threads, in this or a worker process),
``simulator`` (:func:`run_pattern`: W ranks, etcd's counts before/after), ``etcd_metrics``
(etcd's ``/metrics``), ``tcp_server`` (the TCPStore contender), ``fit`` (exponents and the
paper extrapolation), ``host_sharing`` (stores behind one grpc-proxy), ``watch_cpu``
(client CPU per watch event), ``suite`` (the whole run) and ``report`` (``FANOUT.md``).
"""

from .etcd_metrics import Counts, EtcdSample
from .patterns import PATTERNS, Pattern
from .simulator import PatternResult, run_pattern

__all__ = ["PATTERNS", "Counts", "EtcdSample", "Pattern", "PatternResult", "run_pattern"]
