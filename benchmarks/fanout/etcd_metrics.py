"""etcd's own view of the traffic, from its ``/metrics`` endpoint: :class:`EtcdSample`.

Everything the fan-out benchmark reports about etcd comes from here, never from client-side
counters:

- unary requests by gRPC method: ``grpc_server_handled_total{grpc_type="unary"}``;
- raft proposals: ``etcd_server_proposals_committed_total``;
- watch streams opened: ``grpc_server_started_total{grpc_method="Watch"}``;
- watch messages etcd sent / received: ``grpc_server_msg_sent_total`` /
  ``grpc_server_msg_received_total`` with ``grpc_method="Watch"``;
- the current revision (``etcd_debugging_mvcc_current_revision``) and the open watch streams
  and watchers (``etcd_debugging_mvcc_watch_stream_total``, ``..._watcher_total``).

Every watch message a client sends (create, cancel, progress request) is answered by exactly
one message from etcd; so ``sent - received`` is the number of *event* messages etcd pushed
(:attr:`Counts.watch_event_msgs`), the part that grows with writes × watchers.

:func:`sample` blocks for one HTTP GET (bounded by ``timeout``); :class:`SettledSampler`
adds one Status call and waits for etcd's proposal gauge to catch up (see there); everything
else is pure.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3 import etcdrpc

__all__ = ["Counts", "EtcdSample", "SettledSampler", "sample"]


@dataclass(frozen=True)
class EtcdSample:
    """One scrape of etcd's ``/metrics`` (counters are totals since etcd started)."""

    requests: dict[str, float] = field(default_factory=dict)  # unary, by gRPC method
    proposals: float = 0.0
    watch_streams_started: float = 0.0
    watch_msgs_sent: float = 0.0
    watch_msgs_received: float = 0.0
    revision: int = 0
    watch_streams_open: int = 0
    watchers_open: int = 0

    def minus(self, before: EtcdSample) -> Counts:
        """The traffic between ``before`` and this sample."""
        methods = set(self.requests) | set(before.requests)
        requests = {m: int(round(self.requests.get(m, 0) - before.requests.get(m, 0)))
                    for m in sorted(methods)}
        return Counts(
            requests={m: n for m, n in requests.items() if n},
            proposals=int(round(self.proposals - before.proposals)),
            watch_streams=int(round(self.watch_streams_started - before.watch_streams_started)),
            watch_msgs_sent=int(round(self.watch_msgs_sent - before.watch_msgs_sent)),
            watch_msgs_received=int(round(self.watch_msgs_received - before.watch_msgs_received)),
            revisions=self.revision - before.revision,
        )


@dataclass(frozen=True)
class Counts:
    """etcd's traffic during one measured interval (differences of :class:`EtcdSample`).

    ``requests`` are unary gRPC calls by method (``Range``, ``Txn``, ``Put`` ...);
    ``revisions`` is how many write revisions etcd created (one per successful put or
    writing Txn); ``watch_streams`` is streams opened.
    """

    requests: dict[str, int] = field(default_factory=dict)
    proposals: int = 0
    watch_streams: int = 0
    watch_msgs_sent: int = 0
    watch_msgs_received: int = 0
    revisions: int = 0

    @property
    def total_requests(self) -> int:
        """Unary requests plus the watch messages clients sent (creates, progress requests)."""
        return sum(self.requests.values()) + self.watch_msgs_received

    @property
    def unary_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def watch_event_msgs(self) -> int:
        """Watch messages etcd pushed that were not answers to a client message: events."""
        return max(0, self.watch_msgs_sent - self.watch_msgs_received)

    def per_rank(self, world: int) -> dict[str, float]:
        """The headline figures divided by ``world`` (for the per-rank tables)."""
        w = max(1, world)
        return {
            "requests": self.total_requests / w,
            "unary_requests": self.unary_requests / w,
            "proposals": self.proposals / w,
            "watch_msgs_sent": self.watch_msgs_sent / w,
            "watch_event_msgs": self.watch_event_msgs / w,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests), "total_requests": self.total_requests,
            "unary_requests": self.unary_requests, "proposals": self.proposals,
            "watch_streams": self.watch_streams, "watch_msgs_sent": self.watch_msgs_sent,
            "watch_msgs_received": self.watch_msgs_received,
            "watch_event_msgs": self.watch_event_msgs, "revisions": self.revisions,
        }


def parse(text: str) -> EtcdSample:
    """An :class:`EtcdSample` from the text of one ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    requests: dict[str, float] = {}
    values = {"proposals": 0.0, "started": 0.0, "sent": 0.0, "received": 0.0,
              "revision": 0.0, "streams": 0.0, "watchers": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            method = labels.get("grpc_method")
            if s.name == "grpc_server_handled_total" and labels.get("grpc_type") == "unary":
                requests[method] = requests.get(method, 0.0) + s.value
            elif method == "Watch" and s.name == "grpc_server_started_total":
                values["started"] += s.value
            elif method == "Watch" and s.name == "grpc_server_msg_sent_total":
                values["sent"] += s.value
            elif method == "Watch" and s.name == "grpc_server_msg_received_total":
                values["received"] += s.value
            elif s.name in ("etcd_server_proposals_committed_total",
                            "etcd_server_proposals_committed"):
                values["proposals"] = s.value
            elif s.name == "etcd_debugging_mvcc_current_revision":
                values["revision"] = s.value
            elif s.name == "etcd_debugging_mvcc_watch_stream_total":
                values["streams"] = s.value
            elif s.name == "etcd_debugging_mvcc_watcher_total":
                values["watchers"] = s.value
    return EtcdSample(requests=requests, proposals=values["proposals"],
                      watch_streams_started=values["started"], watch_msgs_sent=values["sent"],
                      watch_msgs_received=values["received"], revision=int(values["revision"]),
                      watch_streams_open=int(values["streams"]),
                      watchers_open=int(values["watchers"]))


def sample(metrics_url: str, timeout: float = 10.0) -> EtcdSample:
    """Scrape ``metrics_url + "/metrics"`` (no HTTP proxy); blocks for one GET."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(metrics_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


class SettledSampler:
    """Scrapes of one etcd member that count every proposal it committed before the call.

    etcd sets ``etcd_server_proposals_committed_total`` only after writing to its WAL the
    raft batch that committed them, and a leader applies that batch, and answers the
    clients waiting on it, while the write runs: a scrape taken just after an answer can
    miss that answer's proposal (an off-by-one seen in CI). So each call first asks the
    member's Status for its committed raft index, which etcd records before it applies
    anything, and scrapes until the gauge has reached it (bounded by ``timeout``:
    TimeoutError). The Status calls this sampler made are taken off the ``Status`` count,
    so that differences of its samples count only the traffic measured.

    ``endpoint`` is ``host:port`` of the member's plaintext gRPC port. Blocking; not
    thread-safe; :meth:`close` releases the channel.
    """

    def __init__(self, endpoint: str, metrics_url: str, timeout: float = 10.0) -> None:
        self._metrics_url = metrics_url
        self._timeout = timeout
        self._channel = grpc.insecure_channel(endpoint)
        self._status = etcdrpc.MaintenanceStub(self._channel).Status
        self._probes = 0

    def __call__(self) -> EtcdSample:
        deadline = time.monotonic() + self._timeout
        committed = self._status(etcdrpc.StatusRequest(), timeout=self._timeout).raftIndex
        self._probes += 1
        while True:
            now = sample(self._metrics_url, self._timeout)
            if now.proposals >= committed:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd's proposals gauge stayed at {now.proposals:.0f}, "
                                   f"below its committed index {committed}")
            time.sleep(0.001)
        requests = dict(now.requests)
        requests["Status"] = requests.get("Status", 0.0) - self._probes
        return dataclasses.replace(now, requests=requests)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SettledSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
