"""What the demo shows: the live progress bars (stderr) and the summary table (rich).

rich is imported only when something is shown (the CLI checks that it is installed);
the JSON form of the summary is printed by the CLI as it is.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .figures import LATENCIES, UNITS
from .settings import MODES
from .uncached import UNCACHED_MEANS


class Progress:
    """The live display: a rich progress bar per phase, on stderr. Main thread only."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._total = total
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self.console = Console(stderr=True)
            self._progress = RichProgress(
                TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("rounds"), TimeElapsedColumn(), console=self.console)

    def note(self, text: str) -> None:
        """Print one line above the bars (nothing when disabled)."""
        if self.enabled:
            self.console.print(text, highlight=False)

    def __enter__(self) -> Progress:
        if self._progress is not None:
            self._progress.start()
            for mode in MODES:
                self._tasks[mode] = self._progress.add_task(mode, total=self._total,
                                                            start=False)
        return self

    def start(self, mode: str) -> None:
        if self._progress is not None:
            self._progress.start_task(self._tasks[mode])

    def advance(self, mode: str) -> None:
        if self._progress is not None:
            self._progress.advance(self._tasks[mode])

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            # After SIGHUP the terminal may be gone (EIO): that must not replace the
            # interrupt being handled.
            with contextlib.suppress(OSError):
                self._progress.stop()


def _fmt_seconds(value: float) -> str:
    """Three significant digits (one decimal at least below 10 µs): 0.8 µs, 657 µs, 3.30 ms."""
    for scale, unit in ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s")):
        scaled = value / scale
        if scaled < 1000 or unit == "s":
            if unit == "µs" and scaled < 10:
                return f"{scaled:.1f} {unit}"
            digits = 0 if scaled >= 100 else 1 if scaled >= 10 else 2
            return f"{scaled:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}×"


def _fmt_count(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _fmt_latency(phase: dict[str, Any], key: str, unit: str) -> str:
    """``p50 / p99`` of one of a phase summary's :data:`~.figures.LATENCIES`."""
    seconds = 1 / UNITS[unit][0]
    return " / ".join(_fmt_seconds(phase[f"{key}_p{q}_{unit}"] * seconds) for q in (50, 99))


def render_table(summary: dict[str, Any]) -> Any:
    """The summary as a rich renderable (a table with a footnote)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c, u, red = summary["cached"], summary["uncached"], summary["reduction"]
    title = (f"cachedstore demo: {summary['workers']} workers × {summary['rounds']} rounds × "
             f"{summary['hot_reads_per_round']} hot reads, etcd {summary['etcd']['version']}")
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("cached", justify="right")
    table.add_column("uncached", justify="right")
    table.add_column("reduction", justify="right")

    table.add_row("wall time", _fmt_seconds(c["wall_seconds"]),
                  _fmt_seconds(u["wall_seconds"]), _fmt_ratio(red["wall_time"]))
    table.add_row("operations", f"{c['operations']:,}", f"{u['operations']:,}", "")
    table.add_row("hit ratio (reads)", f"{c['hit_ratio']:.1%}", "— (no cache)", "")
    for key, label, unit in LATENCIES:
        reduction = _fmt_ratio(red[f"{key}_p50"]) if f"{key}_p50" in red else ""
        table.add_row(f"{label} p50 / p99", _fmt_latency(c, key, unit),
                      _fmt_latency(u, key, unit), reduction)
    table.add_row("etcd requests, client", _fmt_count(c["etcd_requests_client"]),
                  _fmt_count(u["etcd_requests_client"]),
                  _fmt_ratio(red["etcd_requests_client"]))
    table.add_row("etcd requests, etcd", _fmt_count(c["etcd_requests_server"]),
                  _fmt_count(u["etcd_requests_server"]),
                  _fmt_ratio(red["etcd_requests_server"]))
    notes = Text(
        f"{UNCACHED_MEANS}\nclient: unary RPCs + watch streams opened (the workers' "
        f"cachedstore_etcd_requests_total); etcd: grpc_server_handled_total on its /metrics"
        f" over the phase.\nOne run on this machine: orientation, not a benchmark "
        f"(see benchmarks/).", style="dim")
    return Group(table, notes)
