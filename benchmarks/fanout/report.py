"""``benchmarks/FANOUT.md`` and ``benchmarks/plots/fanout_*.png`` from the saved runs.

:func:`build` reads every ``W*.json`` (one per W, written by ``python -m benchmarks.fanout``)
and ``extras.json`` from a results directory and writes the markdown and the plots. Each W's
figures come from one run of that W (its date is shown); etcd and TCPStore of one W were
measured side by side in that run. Pure apart from reading and writing those files.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

from .fit import (
    ETCD_PUBLISHED,
    TCPSTORE_PUBLISHED,
    etcd_seconds,
    exponent,
    extrapolate,
    tcpstore_published_seconds,
)
from .patterns import PATTERNS

__all__ = ["build", "load"]

TARGET_WS = (8_192, 98_304)
INIT = ("nccl_broadcast", "store_barrier")


def _s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:,.1f} s"


def _n(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def load(results_dir: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """``({W: run}, extras)`` from ``results_dir``."""
    worlds: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(results_dir, "W*.json")):
        with open(path) as f:
            run = json.load(f)
        worlds[int(run["world"])] = run
    extras: dict[str, Any] = {}
    path = os.path.join(results_dir, "extras.json")
    if os.path.exists(path):
        with open(path) as f:
            extras = json.load(f)
    return dict(sorted(worlds.items())), extras


def _runs(worlds: dict[int, dict[str, Any]], backend: str) -> dict[str, dict[int, Any]]:
    out: dict[str, dict[int, Any]] = {}
    for w, run in worlds.items():
        for r in run["runs"]:
            if r["backend"] == backend:
                out.setdefault(r["pattern"], {})[w] = r
    return out


def _per_rank(r: dict[str, Any] | None, key: str) -> float | None:
    return None if r is None or not r.get("per_rank") else r["per_rank"][key]


def _total(r: dict[str, Any] | None, key: str) -> float | None:
    return None if r is None or not r.get("counts") else float(r["counts"][key])


def _cpu_per_rank(r: dict[str, Any] | None) -> str:
    """Client CPU per rank in µs (process CPU time of the rank processes over W)."""
    if r is None or "client_cpu_s" not in r:
        return "–"
    return f"{r['client_cpu_s'] / r['world'] * 1e6:,.0f} µs"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def breakdown_row(r: dict[str, Any], t: dict[str, Any] | None) -> list[str] | None:
    """One rank's wall time of ``r`` (means over ranks and steps), in ms: its wall, the
    wait for its thread, its CPU, waiting for etcd's answers (time in ``Connection.call``
    less the CPU spent in it), waiting for the watch's event, the rest (runnable but not
    running: the GIL, the scheduler); then the process CPU per rank by thread kind (µs),
    and TCPStore's rank wall and CPU beside it. None for results without a breakdown."""
    b = r.get("breakdown") or {}
    n = b.get("ranks", 0)
    if not n:
        return None
    wall, cpu, watch = b["wall"] / n, b["cpu"] / n, b["watch"] / n
    etcd = max(0.0, b["etcd"] - b["etcd_cpu"]) / n
    rest = max(0.0, wall - cpu - etcd - watch)
    w = r["world"]
    threads = r.get("cpu_by_thread") or {}
    split = " / ".join(f"{threads.get(k, 0.0) / w * 1e6:,.0f}"
                       for k in ("rank", "watch", "python", "native")) if threads else "–"
    tb = (t or {}).get("breakdown") or {}
    tn = tb.get("ranks", 0)
    tcp = (f"{_ms(tb['wall'] / tn)} ms, CPU {_ms(tb['cpu'] / tn)} ms" if tn else "–")
    return [str(w), _ms(wall), _ms(b["start"] / n), _ms(cpu), _ms(b["etcd_cpu"] / n),
            _ms(etcd), _ms(watch), _ms(rest), _cpu_per_rank(r), split, tcp]


BREAKDOWN_HEADER = ["W", "rank wall", "thread start wait", "own CPU",
                    "of which in etcd calls", "waiting for etcd", "waiting for the watch",
                    "rest (GIL, scheduler)", "client CPU / rank",
                    "by thread: rank / watch / other Python / native (µs)",
                    "TCPStore rank wall, CPU"]


def _machine(run: dict[str, Any]) -> str:
    m = run.get("machine")
    if not m:
        return "not recorded"
    label = m.get("label")
    what = f"{m.get('cores', '?')} cores, torch {m.get('torch', '?')}"
    return f"{label} ({what})" if label else what


def _connect_per_rank(r: dict[str, Any]) -> tuple[float, float, float]:
    """(requests, unary requests, proposals) per rank of building the W stores."""
    c, w = r["connect"], r["world"]
    return c["total_requests"] / w, c.get("unary_requests", 0) / w, c["proposals"] / w


def markdown(worlds: dict[int, dict[str, Any]], extras: dict[str, Any],
             plot_files: list[str], command: str, notes: str = "") -> str:
    """The report; ``notes`` (markdown: :data:`NOTES`, measurements made outside the suite,
    by hand) goes in before the plots."""
    etcd, tcp = _runs(worlds, "etcd"), _runs(worlds, "tcp")
    ws = list(worlds)
    lines = [
        "# Fan-out benchmark: torch's coordination traffic at W simulated ranks",
        "",
        f"Generated by `{command}` (issue 11). Do not edit by hand: rerun (measurements made "
        f"outside the suite live in `benchmarks/fanout/notes.md`, copied in before the "
        f"plots). Every rank is a "
        "thread with its own store (its own `EtcdStore`: connection, watch, cache; or its own "
        "`TCPStore` client of one server), all against one single-member etcd 3.5.1 on "
        "loopback; larger W run as threads of several worker processes. Counts are etcd's "
        "own (`/metrics`), taken after every store's watch applied the last revision. "
        "TCPStore ran the same pattern code in the same run (wall time only: it has no "
        "etcd). Patterns and key names follow torch 2.13's sources "
        "(see `benchmarks/fanout/patterns.py`).",
        "",
        "*requests*: unary gRPC calls + messages clients sent on watch streams (creates, "
        "progress requests); *proposals*: `etcd_server_proposals_committed_total`; *watch "
        "msgs*: `grpc_server_msg_sent_total{grpc_method=\"Watch\"}` (of which *events* = sent "
        "− received: messages that were not answers); *PINGs*: HTTP/2 PINGs the stores' "
        "quiet watch streams sent (`cachedstore_watch_liveness_requests_total`, counted by "
        "the stores: etcd answers them in its gRPC transport and counts no request). All "
        "per rank unless marked.",
        "",
        "*client CPU / rank*: CPU time of the processes the ranks ran in (every thread: "
        "ranks, watches, gRPC), during the measured steps, over W. *One rank's wall time*: "
        "means over ranks of each rank's own step, from its thread taking the step up "
        "(*thread start wait*: from the step's submission until then) to its end: *own "
        "CPU* (the rank thread's CPU time, *of which in etcd calls*), *waiting for etcd* "
        "(wall time inside `Connection.call` less the CPU spent there), *waiting for the "
        "watch* (blocked in the store's waits for the watch's event), *rest* (runnable "
        "but not running: the GIL, the scheduler); the process CPU per rank by thread "
        "(the rank threads, the stores' watch threads, other Python threads, threads "
        "Python did not start: gRPC's core). Measured from outside the library "
        "(`benchmarks/fanout/worker.py` wraps `Connection.call` and the clock's wait).",
        "",
        "## Runs",
        "",
        _table(["W", "date", "machine", "worker processes", "budget per pattern", "run time",
                "loadavg", "store options"],
               [[str(w), r.get("date", "?"), _machine(r), str(r["processes"]),
                 _s(r["budget_s"]), _s(r["elapsed_s"]), str(r.get("loadavg", "?")),
                 ", ".join(f"{k}={v}" for k, v in sorted(r.get("store_options", {}).items()))
                 or "defaults"] for w, r in worlds.items()]),
        "",
    ]
    for w, r in worlds.items():
        if r.get("skipped"):
            lines.append(f"W={w}: not run (time budget of the run spent): "
                         f"{', '.join(r['skipped'])}.")
        for name, reason in sorted(r.get("unsupported", {}).items()):
            lines.append(f"W={w}: {name} not run on this torch: {reason}.")
    by_note: dict[str, list[int]] = {}
    for w, r in worlds.items():
        for n in r.get("notes", []):
            by_note.setdefault(n, []).append(w)
    if by_note:
        lines += ["", "Implementations exercised (runs before issue 26 named the class's "
                  "override; later runs, what the ranks' stores were called with): " + "; ".join(
                      f"{n} (W = {', '.join(map(str, ws))})"
                      for n, ws in sorted(by_note.items())) + ".", ""]

    lines += ["## Per pattern and W", ""]
    for name, by_w in etcd.items():
        lines += [f"### {PATTERNS[name].title if name in PATTERNS else name}", ""]
        rows = []
        for w in ws:
            r, t = by_w.get(w), tcp.get(name, {}).get(w)
            if r is None:
                continue
            ratio = (r["wall_s"] / t["wall_s"]) if t and t["wall_s"] > 0 else None
            rows.append([
                str(w), _s(r["wall_s"]) + ("" if r["finished"] else " **DNF**"),
                _s(t["wall_s"]) if t else "–", f"{ratio:,.0f}×" if ratio else "–",
                _cpu_per_rank(r), _cpu_per_rank(t),
                _n(_per_rank(r, "requests")), _n(_per_rank(r, "proposals")),
                _n(_per_rank(r, "watch_msgs_sent"), 1), _n(_per_rank(r, "watch_event_msgs"), 1),
                _n(r["extras"]["liveness_ping"] / w if "liveness_ping" in r.get("extras", {})
                   else None),
                ", ".join(f"{k} {v:,}" for k, v in sorted(r["counts"]["requests"].items())),
                f"{r['needed_deliveries']:,}"])
        lines += [_table(["W", "cachedstore wall", "TCPStore wall", "ratio",
                          "client CPU / rank", "TCPStore client CPU / rank", "requests",
                          "proposals", "watch msgs", "of which events", "PINGs",
                          "etcd requests (total, by method)", "deliveries needed (total)"],
                         rows), ""]
        split = [row for w in ws if w in by_w
                 for row in [breakdown_row(by_w[w], tcp.get(name, {}).get(w))] if row]
        if split:
            lines += ["One rank's wall time (ms, mean over ranks and steps):", "",
                      _table(BREAKDOWN_HEADER, split), ""]
        dnf = [f"W={w}: {'; '.join(by_w[w]['errors'][:2])}" for w in ws
               if w in by_w and not by_w[w]["finished"]]
        if dnf:
            lines += ["Did not finish within the budget (counts are up to the abort): "
                      + " | ".join(dnf), ""]

    # keep-alive races
    ka = [(w, etcd.get("keepalive", {}).get(w), tcp.get("keepalive", {}).get(w)) for w in ws]
    ka = [(w, r, t) for w, r, t in ka if r is not None or t is not None]
    if ka:
        lines += ["## torchrun keep-alive: writes per keep-alive", "",
                  "Each agent's keep-alive as torch's state holder makes it: a read, then "
                  "writes until one lands (a lost compare-and-swap re-reads and writes "
                  "again). 1.00 means no keep-alive lost a race. cachedstore: the `etcd-v3` "
                  "backend (a heartbeat key per node); TCPStore: torch's `c10d` backend (one "
                  "state key).", ""]
        rows = []
        for w, r, t in ka:
            alives = 2 * math.ceil(w / 8)  # every agent, every 5 of the 10 steps
            rows.append([str(w), str(alives)] + [
                _n(x["extras"].get("cas_attempts", 0) / alives) if x and x["finished"] else "–"
                for x in (r, t)])
        lines += [_table(["W", "keep-alives", "cachedstore (etcd-v3)", "TCPStore (c10d)"],
                         rows), ""]

    # connect + init
    lines += ["## Store construction and job init", "",
              "Connect: building the W stores (snapshot read, watch creation). Init = connect "
              "+ NCCL-id broadcast + store-based barrier; issue 11's target is at most 4 "
              "proposals and 6 requests per rank, requests counted as the issue's own table "
              "counts them: etcd's unary requests (`grpc_server_handled_total`, by method). "
              "The requests a rank sends on its watch stream (watch creates, progress "
              "requests) are shown beside them and not judged.", ""]
    rows = []
    for w in ws:
        first = next((r for r in worlds[w]["runs"] if r["backend"] == "etcd"), None)
        if first is None:
            continue
        creq, cunary, cprop = _connect_per_rank(first)
        parts = [etcd.get(p, {}).get(w) for p in INIT]
        if all(p is not None for p in parts):
            ireq = creq + sum(_per_rank(p, "requests") or 0 for p in parts)
            iunary = cunary + sum(_per_rank(p, "unary_requests") or 0 for p in parts)
            iprop = cprop + sum(_per_rank(p, "proposals") or 0 for p in parts)
            met = "✅" if iunary <= 6 and iprop <= 4 else "❌"
            init = (f"{_n(iunary)} unary req + {_n(ireq - iunary)} on the watch stream, "
                    f"{_n(iprop)} proposals {met}")
        else:
            init = "–"
        rows.append([str(w), _n(creq), _n(cprop), _s(first["connect_s"]), init])
    lines += [_table(["W", "connect requests / rank", "connect proposals / rank",
                      "connect wall (all W stores)", "init total / rank"], rows), ""]

    # exponents
    lines += ["## Fitted exponents (total over the job ∝ W^k, log-log least squares)", "",
              "Target (issue 11): requests and proposals per rank flat in W, i.e. total "
              "exponent ≤ 1.05. Only finished runs are fitted.", ""]
    rows = []
    for name, by_w in etcd.items():
        fin = [w for w in ws if w in by_w and by_w[w]["finished"]]
        def k(key: str, fin: list[int] = fin, by_w: dict[int, Any] = by_w) -> str:
            e = exponent(fin, [_total(by_w[w], key) or 0.0 for w in fin])
            return "–" if e is None else f"{e:.2f}"
        kw = exponent(fin, [by_w[w]["wall_s"] for w in fin])
        tw = [w for w in ws if w in tcp.get(name, {})]
        kt = exponent(tw, [tcp[name][w]["wall_s"] for w in tw])
        rows.append([name, ", ".join(map(str, fin)), k("total_requests"), k("proposals"),
                     k("watch_msgs_sent"), "–" if kw is None else f"{kw:.2f}",
                     "–" if kt is None else f"{kt:.2f}"])
    lines += [_table(["pattern", "W fitted", "requests", "proposals", "watch msgs",
                      "cachedstore wall", "TCPStore wall"], rows), ""]

    # extrapolation
    lines += ["## Paper extrapolation to W = 8,192 and 98,304", "",
              "The fitted power laws of the totals, priced at etcd's published throughput "
              f"(3 members on 8 vCPU: {ETCD_PUBLISHED['writes_per_s'][0]:,.0f}–"
              f"{ETCD_PUBLISHED['writes_per_s'][1]:,.0f} writes/s, "
              f"{ETCD_PUBLISHED['reads_per_s'][0]:,.0f} linearizable reads/s; watch "
              f"deliveries at {ETCD_PUBLISHED['watch_events_per_s'][0]:,.0f}–"
              f"{ETCD_PUBLISHED['watch_events_per_s'][1]:,.0f} events/s as etcd-io/etcd#4686 "
              "measured them): a lower bound on etcd's time, no queueing, no client CPU. "
              f"TCPStore: the published {TCPSTORE_PUBLISHED[0]:,}-rank init in "
              f"~{TCPSTORE_PUBLISHED[1]:.0f} s (libuv), scaled linearly, next to this run's "
              "TCPStore wall extrapolated by its own fit.", ""]
    rows = []
    for name, by_w in etcd.items():
        fin = [w for w in ws if w in by_w and by_w[w]["finished"]]
        if len(fin) < 2:
            continue
        for at in TARGET_WS:
            prop = extrapolate(fin, [_total(by_w[w], "proposals") or 0.0 for w in fin], at)
            req = extrapolate(fin, [_total(by_w[w], "total_requests") or 0.0 for w in fin], at)
            msgs = extrapolate(fin, [_total(by_w[w], "watch_msgs_sent") or 0.0 for w in fin],
                               at)
            reads = max(0.0, (req or 0.0) - (prop or 0.0))
            best, worst = etcd_seconds(prop or 0.0, reads, msgs or 0.0)
            tw = [w for w in ws if w in tcp.get(name, {})]
            tcp_at = extrapolate(tw, [tcp[name][w]["wall_s"] for w in tw], at)
            rows.append([name, f"{at:,}", _n(prop, 0), _n(req, 0), _n(msgs, 0),
                         f"{_s(best)} – {_s(worst)}", _s(tcp_at),
                         _s(tcpstore_published_seconds(at))])
    lines += [_table(["pattern", "W", "proposals", "requests", "watch msgs",
                      "etcd time (published rates)", "TCPStore (this run's fit)",
                      "TCPStore init (published, linear)"], rows), ""]

    # Megatron groups: sent vs needed
    g = etcd.get("groups", {})
    if g:
        lines += ["## Megatron groups: watch messages etcd sent vs deliveries needed", "",
                  "Groups TP 8 × PP ≤ 4 × DP (the rest); each group runs gloo's all-gather "
                  "and the NCCL-id broadcast under its own PrefixStore. A rank needs the "
                  "events of keys it reads or waits on (written by another rank). Goal 3: "
                  "sent ≤ 2 × needed.", ""]
        rows = []
        for w, r in sorted(g.items()):
            sent = r["counts"]["watch_msgs_sent"]
            events = r["counts"]["watch_event_msgs"]
            need = r["needed_deliveries"]
            ratio = events / need if need else None
            rows.append([str(w), f"{r['semantic_writes']:,}", f"{sent:,}", f"{events:,}",
                         f"{need:,}", f"{ratio:.1f}×" if ratio else "–",
                         ("✅" if ratio is not None and ratio <= 2 else "❌")])
        lines += [_table(["W", "writes", "watch msgs sent", "of which events",
                          "deliveries needed", "events / needed", "≤ 2×"], rows), ""]

    hs = extras.get("host_sharing")
    if hs:
        d, p = hs["direct"], hs["proxy"]
        lines += ["## Per-host sharing (goal 5): 8 stores behind one grpc-proxy vs 8 direct",
                  "", f"A raw client puts {d['writes']} keys under the stores' prefix. etcd's "
                  "own counts; the proxy coalesces equal-range watches whose next revision "
                  "is not ahead of its group's and drops a client stream blocked 50 ms (not "
                  "exercised here).", ""]
        rows = [[name, str(x["watch_streams_opened"]), str(x["watchers_open_at_etcd"]),
                 f"{x['watch_msgs_sent']:,}", _n(x["watch_msgs_per_write"], 1),
                 "✅" if x["coherent"] and x["caught_up"] else "❌",
                 f"{x['watch_restarts_after_idle']} after {x['idle_s']:.0f} s idle"]
                for name, x in (("8 direct stores", d), ("8 stores via grpc-proxy", p))]
        lines += [_table(["setup", "watch streams etcd opened", "watchers at etcd",
                          "watch msgs etcd sent", "per write", "every store coherent",
                          "watch restarts"], rows), ""]
    by_transport = extras.get("watch_cpu_by_transport") or {}
    if by_transport:
        first = next(iter(by_transport.values()))
        lines += ["## Client CPU per watch event (goal 6: ≤ 60 µs)", "",
                  f"Another process put {first['events']:,} keys one by one; one store here "
                  "applied them (as RESULTS.md section 3), once per configuration (the "
                  "store's `watch_transport` and `watch_pacing`), the configurations "
                  "interleaved round by round; the median round of each. The CPU window "
                  "holds the store's work only (the writer is connected before it opens "
                  "and reports its last revision itself). Lag: one more round of each, "
                  "timing every event from just before its put to the store's cache "
                  "having applied it (what a non-blocking read can see; a blocked read is "
                  "never paced). Measured "
                  f"{extras.get('date', '?')}.", ""]

        def lag(r: dict[str, Any], key: str) -> str:
            return f"{r[key] * 1e3:.2f}" if key in r else "–"

        rows = [[f"`{t}`", f"**{r['cpu_per_event_s'] * 1e6:.0f}**",
                 f"{r['watch_thread_cpu_per_event_s'] * 1e6:.0f}",
                 f"{r['other_threads_cpu_per_event_s'] * 1e6:.0f}",
                 ", ".join(f"{x * 1e6:.0f}" for x in r.get("rounds_cpu_per_event_s", [])),
                 lag(r, "lag_p50_s"), lag(r, "lag_p99_s"),
                 "✅" if r["cpu_per_event_s"] <= 60e-6 and r["caught_up"] else "❌"]
                for t, r in sorted(by_transport.items(), key=lambda item: (
                    item[1].get("watch_transport") != "grpc", item[1].get("watch_pacing", 0)))]
        lines += [_table(["configuration", "µs CPU per event", "watch thread",
                          "other threads", "every round", "lag p50 ms", "lag p99 ms",
                          "≤ 60 µs"], rows), ""]
    if notes.strip():
        lines += [notes.strip(), ""]
    for f in plot_files:
        lines += [f"![{f}](plots/{f})", ""]
    return "\n".join(lines).rstrip() + "\n"


def plots(worlds: dict[int, dict[str, Any]], plots_dir: str) -> list[str]:
    """``fanout_requests.png``, ``fanout_watch.png``, ``fanout_wall.png``; their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etcd, tcp = _runs(worlds, "etcd"), _runs(worlds, "tcp")
    os.makedirs(plots_dir, exist_ok=True)
    made = []
    for fname, key, ylabel in (("fanout_requests.png", "requests", "etcd requests per rank"),
                               ("fanout_watch.png", "watch_msgs_sent",
                                "watch messages etcd sent per rank")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, by_w in etcd.items():
            xs = sorted(w for w in by_w if by_w[w].get("per_rank"))
            ys = [max(1e-3, by_w[w]["per_rank"][key]) for w in xs]
            if xs:
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("W (simulated ranks)")
        ax.set_ylabel(ylabel + " (log)")
        ax.set_title(ylabel + " vs W (flat = O(1) per rank)")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, fname), dpi=110)
        plt.close(fig)
        made.append(fname)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, by_w) in enumerate(etcd.items()):
        xs = sorted(by_w)
        color = f"C{i % 10}"
        ax.plot(xs, [by_w[w]["wall_s"] for w in xs], marker="o", color=color,
                label=f"{name} (cachedstore)")
        t = tcp.get(name, {})
        tx = sorted(t)
        if tx:
            ax.plot(tx, [t[w]["wall_s"] for w in tx], marker="x", linestyle="--", color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("W (simulated ranks)")
    ax.set_ylabel("wall time, s (log); dashed: TCPStore, same run")
    ax.set_title("Wall time per pattern")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(plots_dir, "fanout_wall.png"), dpi=110)
    plt.close(fig)
    made.append("fanout_wall.png")
    return made


#: Measurements made by hand, outside the suite (one-off comparisons, other commands'
#: runs), written in markdown: copied into the report, before its plots.
NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notes.md")


def build(results_dir: str, out_md: str, plots_dir: str, command: str) -> list[str]:
    """Write ``out_md`` and the plots from ``results_dir``; return the plot names."""
    worlds, extras = load(results_dir)
    try:
        made = plots(worlds, plots_dir) if worlds else []
    except ImportError:  # no matplotlib here: the plots drawn before, if any
        made = [f for f in ("fanout_requests.png", "fanout_watch.png", "fanout_wall.png")
                if os.path.exists(os.path.join(plots_dir, f))]
    notes = ""
    if os.path.exists(NOTES):
        with open(NOTES) as f:
            notes = f.read()
    with open(out_md, "w") as f:
        f.write(markdown(worlds, extras, made, command, notes))
    return made
