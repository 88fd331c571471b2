"""The fan-out benchmark on a torch older than 2.13 (issue 26, item 4).

torch 2.11's ``torch.distributed.Store`` has no ``barrier``: the benchmark stopped there
with an AttributeError after the patterns had run. Only torch 2.13 is installed here, so
these tests take ``Store.barrier`` away (``monkeypatch``) and run the benchmark's own code
in this process (``processes=0``): the pattern that needs it is skipped with a note in the
result and the report, the others run, and nothing else assumes 2.13. Also checked: the
client CPU and one rank's wall-time breakdown the report shows.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from benchmarks.fanout.patterns import PATTERNS, store_has
from benchmarks.fanout.report import markdown
from benchmarks.fanout.simulator import PatternUnsupportedError, run_pattern
from benchmarks.fanout.suite import run_world
from cachedstore.server import LocalEtcd

W = 4


@pytest.fixture
def no_store_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as torch 2.11 is: no ``Store.barrier`` (nor on its subclasses)."""
    monkeypatch.delattr(dist.Store, "barrier")
    assert not hasattr(dist.PrefixStore, "barrier")


def test_the_patterns_that_need_a_newer_torch_say_so(no_store_barrier: None) -> None:
    reason = PATTERNS["store_api_barrier"].unsupported(W)
    assert reason is not None and "barrier" in reason and "Store" in reason
    assert PATTERNS["store_barrier"].unsupported(W) is None
    assert PATTERNS["nccl_broadcast"].unsupported(W) is None  # no multi_get below 129
    with pytest.raises(PatternUnsupportedError, match="barrier"):
        run_pattern("store_api_barrier", W, tcp_endpoint="127.0.0.1:1")


def test_multi_get_is_detected_too(monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_has("multi_get") is None
    monkeypatch.delattr(dist.Store, "multi_get")
    assert PATTERNS["groups"].unsupported(W) is not None
    assert PATTERNS["nccl_broadcast"].unsupported(W) is None
    assert PATTERNS["nccl_broadcast"].unsupported(256) is not None


def test_run_skips_the_pattern_and_reports_it(etcd: LocalEtcd,
                                              no_store_barrier: None) -> None:
    run = run_world(W, etcd.endpoint, etcd.metrics_url,
                    patterns=["store_api_barrier", "store_barrier"], budget=60,
                    processes=0, log=lambda *_: None)
    assert set(run["unsupported"]) == {"store_api_barrier"}
    ran = {(r["pattern"], r["backend"]) for r in run["runs"]}
    assert ran == {("store_barrier", "etcd"), ("store_barrier", "tcp")}
    assert all(r["finished"] and not r["errors"] for r in run["runs"])
    assert not any(n.startswith("store_api_barrier") for n in run["notes"])
    text = markdown({W: run}, {}, [], "test")
    assert "store_api_barrier not run on this torch" in text
    assert "### Store.barrier" not in text


def test_breakdown_and_client_cpu_are_reported(etcd: LocalEtcd) -> None:
    run = run_world(W, etcd.endpoint, etcd.metrics_url, patterns=["store_api_barrier"],
                    budget=60, processes=0, log=lambda *_: None)
    assert not run["unsupported"]
    etcd_run = next(r for r in run["runs"] if r["backend"] == "etcd")
    b = etcd_run["breakdown"]
    assert b["ranks"] == W and b["wall"] > 0 and b["cpu"] > 0
    assert b["etcd"] > 0  # every rank's add is a Txn
    assert b["etcd_cpu"] <= b["etcd"] and b["cpu"] <= b["wall"] + 0.05 * W
    assert etcd_run["client_cpu_s"] > 0
    assert set(etcd_run["cpu_by_thread"]) == {"rank", "watch", "python", "native"}
    # Which barrier ran is what the stores saw, not what torch's version suggests.
    assert any(n.startswith("store_api_barrier: ") for n in run["notes"])
    text = markdown({W: run}, {}, [], "test")
    assert "One rank's wall time" in text and "client CPU / rank" in text
