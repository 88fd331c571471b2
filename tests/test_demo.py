"""``cachedstore demo`` end to end, its uncached contender, and its clean-up on Ctrl-C.

The demo's modules are tested through it: ``settings.py`` (its options), ``workload.py``
and ``uncached.py`` (the two phases), ``run.py`` (the workers and their clean-up),
``figures.py`` and ``report.py`` (what it prints and writes)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry

from cachedstore import EtcdStore
from cachedstore.config import StoreConfig
from cachedstore.connection import Credentials
from cachedstore.demo import UNCACHED_MEANS, UncachedClient, render_table
from cachedstore.metrics import StoreMetrics
from cachedstore.server import LocalEtcd, free_port

pytestmark = pytest.mark.timeout(90)

SHORT = ["--workers", "2", "--rounds", "3", "--hot-reads", "20"]


def demo(*args: str, env: dict[str, str] | None = None, timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDSTORE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "cachedstore", "demo", *args],
                          capture_output=True, text=True, timeout=timeout, env=full_env,
                          check=False)


def check_summary(summary: dict[str, Any], workers: int, rounds: int, hot: int) -> None:
    cached, uncached = summary["cached"], summary["uncached"]
    ops = workers * rounds * (4 + hot) + 1 + rounds  # + the config write, + one "done"/round
    assert cached["operations"] == uncached["operations"] == ops
    assert cached["reads"] == uncached["reads"] == workers * rounds * (workers + 1 + hot)
    assert 0 < cached["hit_ratio"] <= 1 and uncached["hit_ratio"] is None
    assert cached["cache_hits"] + cached["cache_misses"] == cached["reads"]
    for phase in (cached, uncached):
        assert 0 < phase["hot_read_p50_us"] <= phase["hot_read_p99_us"]
        assert 0 < phase["all_gather_p50_ms"] <= phase["all_gather_p99_ms"]
        assert 0 < phase["barrier_p50_ms"] <= phase["barrier_p99_ms"]
        assert phase["etcd_requests_client"] == sum(
            phase["etcd_requests_client_by_method"].values())
    # every uncached read is an RPC; the cached phase sends far fewer
    assert uncached["etcd_requests_client_by_method"]["range"] >= workers * rounds * hot
    assert cached["etcd_requests_client"] < uncached["etcd_requests_client"]
    assert cached["etcd_requests_server"] < uncached["etcd_requests_server"]
    # etcd's own count agrees with the clients' (nothing else talks to this etcd)
    assert cached["etcd_requests_server"] >= cached["etcd_requests_client"]
    assert summary["reduction"]["etcd_requests_server"] > 1
    assert summary["uncached_means"] == UNCACHED_MEANS


def test_short_run_embedded_etcd_json() -> None:
    done = demo(*SHORT, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["etcd"]["embedded"] is True
    assert (summary["workers"], summary["rounds"], summary["hot_reads_per_round"]) == (2, 3, 20)
    check_summary(summary, 2, 3, 20)
    # the embedded etcd's counts are exact: one single-member etcd, only our clients
    assert summary["cached"]["etcd_requests_server"] == summary["cached"]["etcd_requests_client"]
    assert "etcd 3." in done.stderr and "removed on exit" in done.stderr  # progress display
    assert "Traceback" not in done.stderr


def test_against_given_endpoints_cleans_up_its_keys(etcd: LocalEtcd) -> None:
    done = demo(*SHORT, "--json", "--quiet", "--endpoints", etcd.endpoint)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["etcd"]["embedded"] is False
    assert summary["prefix"].startswith("/cachedstore-demo/")
    assert done.stderr == ""  # --quiet
    check_summary(summary, 2, 3, 20)
    with EtcdStore(endpoints=[etcd.endpoint], prefix=summary["prefix"]) as store:
        assert store.num_keys() == 0


def test_table_output(etcd: LocalEtcd) -> None:
    done = demo("--workers", "1", "--rounds", "1", "--hot-reads", "5", "--quiet",
                "--endpoints", etcd.endpoint, env={"COLUMNS": "120"})
    assert done.returncode == 0, done.stderr
    for row in ("wall time", "operations", "hit ratio (reads)", "hot read p50 / p99",
                "all-gather p50 / p99", "barrier p50 / p99", "etcd requests, client",
                "etcd requests, etcd", "uncached = a bare etcd v3 client"):
        assert row in done.stdout, row


def test_render_table_from_json_summary() -> None:
    from rich.console import Console

    phase = {"wall_seconds": 1.5, "operations": 10, "reads": 8, "cache_hits": 6,
             "cache_misses": 2, "hit_ratio": 0.75, "hot_read_p50_us": 1.0,
             "hot_read_p99_us": 2.0, "all_gather_p50_ms": 1.0, "all_gather_p99_ms": 2.0,
             "barrier_p50_ms": 1.0, "barrier_p99_ms": 2.0, "etcd_requests_client": 10,
             "etcd_requests_server": None}
    summary = {"workers": 1, "rounds": 1, "hot_reads_per_round": 1,
               "etcd": {"version": "3.5.1"}, "cached": phase,
               "uncached": dict(phase, hit_ratio=None, etcd_requests_client=40),
               "reduction": {"etcd_requests_client": 4.0, "etcd_requests_server": None,
                             "hot_read_p50": 1.0, "wall_time": 1.0}}
    console = Console(record=True, width=120)
    console.print(render_table(summary))
    text = console.export_text()
    assert "75.0%" in text and "4.0×" in text and "n/a" in text and "1.50 s" in text


def test_unreachable_endpoints_exit_3_with_one_line() -> None:
    port = free_port()
    started = time.monotonic()
    done = demo(*SHORT, "--endpoints", f"127.0.0.1:{port}", "--dial-timeout", "0.5")
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachedstore demo: error: "), done.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert time.monotonic() - started < 20


def test_etcd_that_cannot_start_exits_3_with_one_line(tmp_path) -> None:
    done = demo(*SHORT, env={"CACHEDSTORE_ETCD": str(tmp_path / "no-etcd-here")})
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cachedstore demo: error: cannot start etcd: ")


def test_metrics_port_taken_is_a_usage_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        done = demo(*SHORT, "--metrics-port", str(port))
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are both free right now."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def _scrape(url: str) -> str | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def _cache_hits(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cachedstore_cache_requests_total" and s.labels["result"] == "hit")


def test_ctrl_c_stops_workers_and_removes_the_embedded_etcd() -> None:
    base = _two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDSTORE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachedstore", "demo", "--workers", "2", "--rounds", "100000",
         "--metrics-port", str(base)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env)
    try:
        # Running for real: worker 1 serves its metrics and has served reads from its cache.
        deadline = time.monotonic() + 45
        while True:
            text = _scrape(f"http://127.0.0.1:{base + 1}/metrics")
            if text is not None and _cache_hits(text) > 0:
                break
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo never served metrics"
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        etcds = [c for c in children if c.name() == "etcd"]
        assert len(etcds) == 1 and len(children) >= 3  # etcd + 2 workers
        data_dir = next(a for a in etcds[0].cmdline() if a.startswith("--data-dir="))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "cachedstore demo: interrupted"
    assert "Traceback" not in err
    # etcd, the workers and multiprocessing's resource tracker: all gone (the tracker
    # exits on its own once it sees its parent's pipe close)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    assert not os.path.exists(data_dir.split("=", 1)[1])
    assert _scrape(f"http://127.0.0.1:{base}/metrics") is None  # servers gone too


# --------------------------------------------------------------------------- the contender


def _client(etcd: LocalEtcd, prefix: str) -> UncachedClient:
    return UncachedClient([etcd.endpoint], Credentials(), StoreConfig(),
                          StoreMetrics(CollectorRegistry()), prefix)


def test_uncached_blocking_get_is_woken_by_a_put(etcd: LocalEtcd, prefix: str) -> None:
    result: list[bytes] = []
    with _client(etcd, prefix) as reader, _client(etcd, prefix) as writer:
        thread = threading.Thread(target=lambda: result.append(reader.get("k", timeout=20)),
                                  name="test-uncached-get")
        thread.start()
        writer.set("k", "v")  # before or during the wait: the watch starts at the read
        thread.join(30)
        assert result == [b"v"]
        assert reader.mget(["k"], timeout=1) == [b"v"]


def test_uncached_add_is_atomic(etcd: LocalEtcd, prefix: str) -> None:
    def bump(client: UncachedClient) -> None:
        for _ in range(25):
            client.add("counter")

    clients = [_client(etcd, prefix) for _ in range(3)]
    threads = [threading.Thread(target=bump, args=(c,), name=f"test-add-{i}")
               for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert clients[0].get("counter") == b"75"
    assert clients[0].delete_prefix() == 1
    for client in clients:
        client.close()


def test_uncached_wait_times_out(etcd: LocalEtcd, prefix: str) -> None:
    from cachedstore import KeyNotFoundError, StoreTimeoutError

    with _client(etcd, prefix) as client:
        with pytest.raises(StoreTimeoutError):
            client.get("absent", timeout=0.2)
        with pytest.raises(KeyNotFoundError):
            client.mget(["absent"])
        assert client.watch_streams == 1


# --------------------------------------------------------------------------- a terminal


def _run_in_a_pty(argv: list[str], timeout: float) -> tuple[int, bytes]:
    """Run ``argv`` with stdin, stdout and stderr on a pseudo-terminal; its exit code and
    everything it wrote to the terminal."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CACHEDSTORE_") and k not in ("GRPC_VERBOSITY", "NO_COLOR")}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        os.close(master)
    return code, b"".join(chunks)


def test_progress_is_drawn_in_a_terminal() -> None:
    code, output = _run_in_a_pty(
        [sys.executable, "-m", "cachedstore", "demo", "--workers", "1", "--rounds", "5",
         "--hot-reads", "5"], timeout=80)
    assert code == 0, output.decode(errors="replace")
    text = output.decode(errors="replace")
    # rich's live display: the cursor hidden while the bars redraw, the bar glyphs and
    # both phases' rounds counted up to the total
    assert "\x1b[?25l" in text
    assert "━" in text and "5/5" in text and "rounds" in text
    assert "cached" in text and "uncached" in text
    assert "wall time" in text  # and the table after it
    assert not re.search(r"(?m)^[IWEF]\d{4} \d\d:\d\d:\d\d", text), text  # no gRPC logs
