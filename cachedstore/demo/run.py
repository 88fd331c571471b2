"""The demo's orchestration: etcd's lifecycle, the worker processes, the two phases.

Everything started here is undone on every way out (an :class:`contextlib.ExitStack`):
the worker processes are stopped, the throw-away etcd removed, and on a real cluster the
demo's keys deleted, KeyboardInterrupt included. Main thread only.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

from .figures import demo_summary, etcd_counts, phase_summary, settled_etcd_counts
from .report import Progress
from .settings import MODES, DemoError, DemoSettings
from .workload import WorkerSpec, worker_main

#: Seconds the parent waits for the spawned workers to import and report ready.
READY_TIMEOUT = 60.0


def run_demo(settings: DemoSettings, *, progress: bool = True) -> dict[str, Any]:
    """Run the demo and return its summary (what ``--json`` prints).

    Blocks until both phases are done (well under a minute with the defaults on 2 cores).
    Starts and always removes its own etcd when ``settings.endpoints`` is None; stops its
    worker processes and (on a real cluster) deletes its keys on every way out, including
    KeyboardInterrupt, which is re-raised. Raises :class:`DemoError` with an exit code
    when etcd cannot be started or reached or a worker fails. Call from the main thread.
    """
    settings.validate()
    if settings.metrics_port is not None:
        taken = [p for p in range(settings.metrics_port,
                                  settings.metrics_port + settings.workers) if not _port_free(p)]
        if taken:
            raise DemoError(f"--metrics-port: port {taken[0]} on 127.0.0.1 is in use "
                            f"(the demo needs {settings.workers} ports from "
                            f"{settings.metrics_port})", 2)
    total = settings.workers * settings.rounds
    display = Progress(progress, total)
    with contextlib.ExitStack() as stack:
        etcd_info = _start_etcd(settings, display, stack)
        prefix = f"{settings.prefix_root.rstrip('/')}/{secrets.token_hex(4)}/"
        if settings.endpoints is not None:
            stack.callback(_delete_keys, settings, prefix)
        summary = _run_workers(settings, etcd_info, prefix, display, stack)
    return summary


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_etcd(settings: DemoSettings, display: Progress, stack: contextlib.ExitStack
                ) -> dict[str, Any]:
    """Start the throw-away etcd or check the given endpoints; returns where it is."""
    from ..server import EtcdNotFoundError, EtcdStartError, LocalEtcd

    if settings.endpoints is None:
        try:
            etcd = LocalEtcd()
        except EtcdNotFoundError as exc:
            raise DemoError(f"cannot start etcd: {exc}") from None
        stack.callback(etcd.close)
        try:
            etcd.start()
        except EtcdStartError as exc:
            raise DemoError(f"cannot start etcd: {str(exc).splitlines()[0]}") from None
        endpoints: tuple[str, ...] = (etcd.endpoint,)
        metrics_url: str | None = f"{etcd.metrics_url}/metrics"
        embedded = True
    else:
        endpoints = settings.endpoints
        scheme = "https" if settings.ca_cert or settings.cert_cert else "http"
        metrics_url = None if scheme == "https" else f"http://{endpoints[0]}/metrics"
        embedded = False
    with settings.uncached_client(endpoints, "/") as client:
        version = client.status().version
    if etcd_counts(metrics_url) is None:
        metrics_url = None
    where = ("a throw-away local etcd, removed on exit" if embedded
             else "the given cluster; keys under a demo prefix, deleted at the end")
    display.note(f"etcd {version} at {', '.join(endpoints)} ({where})")
    return {"endpoints": list(endpoints), "embedded": embedded, "version": version,
            "metrics_url": metrics_url}


def _delete_keys(settings: DemoSettings, prefix: str) -> None:
    """Delete the demo's keys on a real cluster (best effort, bounded by dial_timeout)."""
    assert settings.endpoints is not None
    with contextlib.suppress(Exception), \
            settings.uncached_client(settings.endpoints, prefix) as client:
        client.delete_prefix()


def _stop_processes(processes: Sequence[Any], abort: Any) -> None:
    """Stop the workers still running (after an error or Ctrl-C): SIGTERM, then SIGKILL."""
    abort.set()
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _run_workers(settings: DemoSettings, etcd_info: dict[str, Any], prefix: str,
                 display: Progress, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Spawn the workers, run both phases in step with them, return the summary."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = [ctx.Event() for _ in MODES]
    abort = ctx.Event()
    endpoints = tuple(etcd_info["endpoints"])
    processes = [
        ctx.Process(target=worker_main, name=f"cachedstore-demo-worker-{rank}",
                    args=(WorkerSpec(rank, settings, endpoints, prefix, os.getpid()),
                          go, abort, out), daemon=True)
        for rank in range(settings.workers)]
    stack.callback(_stop_processes, processes, abort)
    for proc in processes:
        proc.start()

    def receive(kind: str, timeout: float) -> list[Any]:
        """Messages of ``kind`` from every worker; progress messages update the bars."""
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < settings.workers:
            try:
                message = out.get(timeout=0.1)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoError(f"worker {dead[0].name} died (exit code "
                                    f"{dead[0].exitcode})", 6) from None
                if time.monotonic() >= deadline:
                    raise DemoError(f"workers made no progress for {timeout:g} s", 5) from None
                continue
            tag, rank, payload = message
            if tag == "error":
                code, text = payload
                raise DemoError(f"worker {rank}: {text}", code)
            if tag == "progress":
                display.advance(payload)
                deadline = time.monotonic() + timeout
            elif tag == kind:
                got.append(payload)
        return got

    if settings.metrics_port is not None:
        last = settings.metrics_port + settings.workers - 1
        display.note(f"metrics: http://127.0.0.1:{settings.metrics_port}/metrics"
                     + (f" .. :{last}" if last != settings.metrics_port else "")
                     + " (one port per worker)")
    receive("ready", READY_TIMEOUT)
    stall = settings.wait_timeout + 2 * settings.dial_timeout + 10.0
    phases: dict[str, Any] = {}
    with display:
        for index, mode in enumerate(MODES):
            before = etcd_counts(etcd_info["metrics_url"])
            display.start(mode)
            started = time.perf_counter()
            go[index].set()
            results = receive("done", stall)
            wall = time.perf_counter() - started
            after = settled_etcd_counts(etcd_info["metrics_url"], before)
            phases[mode] = phase_summary(results, wall, before, after)
    for proc in processes:  # they exit on their own after the last phase
        proc.join(5.0)
    return demo_summary(settings, etcd_info, prefix, phases)
