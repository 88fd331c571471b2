"""Scaling fits and the paper extrapolation: :func:`exponent`, :func:`extrapolate`.

Pure functions, no I/O. Published figures (orientation, not measurements of this run):

- etcd, 3 members on 8 vCPU (etcd's performance guide): ~44k–50k writes/s and ~141k
  linearizable reads/s; etcd-io/etcd#4686 measured ~46k–95k watch events/s delivered to
  10k watchers.
- TCPStore with libuv initialised 98,304 (96k) ranks in about 100 s (PyTorch's TCPStore
  libuv tutorial).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ETCD_PUBLISHED", "TCPSTORE_PUBLISHED", "exponent", "extrapolate", "power_fit"]

#: (low, high) rates per second from etcd's published benchmarks.
ETCD_PUBLISHED = {"writes_per_s": (44_000.0, 50_000.0), "reads_per_s": (141_000.0, 141_000.0),
                  "watch_events_per_s": (46_000.0, 95_000.0)}
#: ranks, seconds: TCPStore (libuv) initialising a 96k-rank job.
TCPSTORE_PUBLISHED = (98_304, 100.0)


def power_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares of ``log y = log a + k log x``: ``(a, k)``, or None with < 2 usable
    points (zero or negative values are left out)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    k = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return math.exp(my - k * mx), k


def exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The fitted ``k`` of ``y ∝ x^k`` (log-log least squares), or None."""
    fit = power_fit(xs, ys)
    return None if fit is None else fit[1]


def extrapolate(xs: Sequence[float], ys: Sequence[float], at: float) -> float | None:
    """``a · at^k`` from :func:`power_fit`, or None."""
    fit = power_fit(xs, ys)
    return None if fit is None else fit[0] * at ** fit[1]


def etcd_seconds(proposals: float, reads: float, watch_msgs: float) -> tuple[float, float]:
    """(best, worst) seconds a published 3-member etcd needs for that much work: writes at
    44k–50k/s, linearizable reads at 141k/s and watch deliveries at 46k–95k/s, added up
    (a lower bound: no queueing, no client time)."""
    w_lo, w_hi = ETCD_PUBLISHED["writes_per_s"]
    r = ETCD_PUBLISHED["reads_per_s"][0]
    e_lo, e_hi = ETCD_PUBLISHED["watch_events_per_s"]
    best = proposals / w_hi + reads / r + watch_msgs / e_hi
    worst = proposals / w_lo + reads / r + watch_msgs / e_lo
    return best, worst


def tcpstore_published_seconds(world: float) -> float:
    """TCPStore's published 96k-rank init time scaled linearly to ``world`` ranks."""
    ranks, seconds = TCPSTORE_PUBLISHED
    return seconds * world / ranks
