"""Turn one benchmark run's JSON into plots (``plots/*.png``) and ``RESULTS.md``.

``build(results, out_md, plots_dir)`` is called by ``run.py``; ``python report.py
out/results.json`` redraws from a saved run. Everything shown comes from the one run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- formatting


def fmt_s(seconds: float | None) -> str:
    """Seconds with a unit that suits them: ``0.83 µs``, ``312 µs``, ``4.1 ms``, ``1.2 s``."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        v = seconds * 1e6
        return f"{v:.2f} µs" if v < 10 else f"{v:.0f} µs"
    if seconds < 1:
        v = seconds * 1e3
        return f"{v:.2f} ms" if v < 10 else f"{v:.0f} ms"
    return f"{seconds:.2f} s"


def fmt_x(ratio: float | None) -> str:
    if ratio is None or math.isnan(ratio):
        return "–"
    if ratio < 1:
        return f"{ratio:.2f}×"
    return f"{ratio:,.0f}×" if ratio >= 100 else f"{ratio:.1f}×"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ok(flag: bool | None) -> str:
    return "–" if flag is None else ("✅ met" if flag else "❌ missed")


# --------------------------------------------------------------------------- extraction


def _w(results: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in results.get("workloads", {}).items()
            if k.startswith(prefix)}


def hot(results: dict[str, Any], threads: int) -> dict[str, float]:
    return {k: v["median_s"] for k, v in _w(results, f"hot_key/{threads}/").items()}


def targets(results: dict[str, Any]) -> list[list[str]]:
    """The issues' targets, each with the measured figure and whether it was met."""
    h1 = hot(results, 1)
    rows: list[list[str]] = []
    cached = h1.get("cachedstore cached")
    nometrics = h1.get("cachedstore cached, metrics=False")
    raw = h1.get("etcd3 get")
    tcp = [v for k, v in h1.items() if k.startswith("TCPStore")]
    if cached is not None:
        rows.append(["cached get median, metrics on (issue 3: ≤ 2 µs)", fmt_s(cached),
                     ok(cached <= 2e-6)])
    if nometrics is not None:
        rows.append(["cached get median, metrics=False (issue 2: ≤ 1.5 µs)", fmt_s(nometrics),
                     ok(nometrics <= 1.5e-6)])
    if cached and raw:
        rows.append(["cached get vs raw etcd3 get (≥ 100×)", fmt_x(raw / cached),
                     ok(raw / cached >= 100)])
    if cached and tcp:
        rows.append(["cached get vs fastest TCPStore get (≥ 5×)", fmt_x(min(tcp) / cached),
                     ok(min(tcp) / cached >= 5)])
    mg = _w(results, "mget/")
    warm = mg.get("cachedstore mget, warm/1000", {}).get("median_s")
    tcps = [v["median_s"] for k, v in mg.items()
            if k.startswith("TCPStore") and k.endswith("/1000")]
    if warm and tcps:
        rows.append(["warm mget(1000) vs fastest TCPStore multi_get(1000) (faster)",
                     f"{fmt_s(warm)} vs {fmt_s(min(tcps))} ({fmt_x(min(tcps) / warm)})",
                     ok(warm < min(tcps))])
    rt = results.get("workloads", {}).get("mget_round_trips")
    if rt:
        rows.append(["cold mget(1000) etcd RPCs (≤ 8)",
                     f"{rt['store_total']} counted by the store, {rt['etcd_unary_total']} by etcd",
                     ok(max(rt["store_total"], rt["etcd_unary_total"]) <= 8)])
    lag = results.get("workloads", {}).get("coherence/cachedstore blocked get")
    if lag:
        rows.append(["coherence lag p99, blocked get (≤ 10 ms)", fmt_s(lag["p99_s"]),
                     ok(lag["p99_s"] <= 0.010)])
    poll = results.get("workloads", {}).get("coherence/cachedstore polling get")
    if poll:
        rows.append(["coherence lag p99, tight polling get (≤ 10 ms)", fmt_s(poll["p99_s"]),
                     ok(poll["p99_s"] <= 0.010)])
    sc = results.get("workloads", {}).get("allgather_scaling")
    if sc:
        fit = sc["fits"].get("cachedstore", {})
        g, t = fit.get("gather_requests"), fit.get("etcd_requests")
        if g is not None:
            rows.append(["all-gather etcd requests per round grow O(W) (exponent ≈ 1)",
                         f"W^{g:.2f}", ok(g <= 1.2)])
        if t is not None:
            rows.append(["all-gather + barrier (`add`) round, O(W)", f"W^{t:.2f}", ok(t <= 1.2)])
        ta = sc["fits"].get("cachedstore, barrier by arrival keys", {}).get("etcd_requests")
        if ta is not None:
            rows.append(["all-gather + barrier (arrival keys + `wait`) round, O(W)",
                         f"W^{ta:.2f}", ok(ta <= 1.2)])
        r16 = sc.get("ratios", {}).get("torch v2 EtcdStore / cachedstore at W=16")
        if r16:
            rows.append(["≥ 10× fewer etcd requests than torch v2 EtcdStore at W=16: all-gather",
                         fmt_x(r16.get("gather_requests")), ok(r16.get("gather_requests", 0) >= 10)])
            rows.append(["… the same for the all-gather + barrier (`add`) round",
                         fmt_x(r16.get("etcd_requests")), ok(r16.get("etcd_requests", 0) >= 10)])
        ra = sc.get("ratios", {}).get(
            "torch v2 EtcdStore / cachedstore, barrier by arrival keys at W=16")
        if ra:
            rows.append(["… the same for the round with the arrival-key barrier",
                         fmt_x(ra.get("etcd_requests")), ok(ra.get("etcd_requests", 0) >= 10)])
    return rows


# --------------------------------------------------------------------------- plots


def _paired_bars(names: list[str], first: list[float], second: list[float],
                 labels: tuple[str, str], row_height: float, width: float, legend_y: float,
                 xlabel: str, title: str, path: str) -> None:
    """Two horizontal bars per contender on a log axis (1 vs 8 threads, p50 vs p99)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, row_height * len(names) + 1.5))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], first, 0.4, label=labels[0])
    ax.barh([i - 0.2 for i in y], second, 0.4, label=labels[1])
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, legend_y), ncol=2, fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(results: dict[str, Any], plots_dir: str) -> list[str]:
    """Draw the PNGs; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    made = []

    # Hot key latency bars, 1 and 8 threads, log scale.
    h1, h8 = hot(results, 1), hot(results, 8)
    names = sorted(h1, key=h1.get)
    if names:
        _paired_bars(
            names, [h1[n] * 1e6 for n in names],
            [h8.get(n, float("nan")) * 1e6 for n in names],
            ("1 thread", "8 threads (process-wide cost per get)"), 0.45, 10, -0.09,
            "median time per get (µs, log scale)", "Hot key: get of one key",
            os.path.join(plots_dir, "hot_key.png"))
        made.append("hot_key.png")

    # mget time vs N.
    mg = _w(results, "mget/")
    series: dict[str, dict[int, float]] = {}
    for v in mg.values():
        series.setdefault(v["contender"], {})[v["n"]] = v["median_s"]
    if series:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, pts in sorted(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] * 1e3 for x in xs], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("keys per mget")
        ax.set_ylabel("median time (ms)")
        ax.set_title("mget of N keys")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "mget.png"), dpi=110)
        plt.close(fig)
        made.append("mget.png")

    # Coherence / wake-up latency bars.
    co = _w(results, "coherence/")
    if co:
        names = sorted(co, key=lambda n: co[n]["p50_s"])
        _paired_bars(
            names, [co[n]["p50_s"] * 1e3 for n in names], [co[n]["p99_s"] * 1e3 for n in names],
            ("p50", "p99"), 0.6, 9, -0.12,
            "put by another client → visible to the reader (ms, log scale)",
            "Coherence lag and wake-up of blocked gets", os.path.join(plots_dir, "coherence.png"))
        made.append("coherence.png")

    # All-gather: etcd requests and wall time vs W, log-log.
    ag = _w(results, "allgather/")
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for v in ag.values():
        by.setdefault(v["contender"], {})[v["world"]] = v
    if by:
        fig, ax = plt.subplots(figsize=(11, 5.5))
        ws_all: list[int] = []
        for name, pts in sorted(by.items()):
            ws = sorted(w for w in pts if pts[w]["etcd_requests"])
            if not ws:
                continue
            ws_all = sorted(set(ws_all) | set(ws))
            line, = ax.plot(ws, [pts[w]["etcd_requests"] for w in ws], marker="o",
                            label=f"{name}: gather + barrier")
            if not name.startswith("cachedstore,"):  # the variants share the plain gather
                ax.plot(ws, [pts[w]["gather_requests"] for w in ws], marker="x",
                        linestyle="--", color=line.get_color(), label=f"{name}: gather only")
        if ws_all:
            base = by["cachedstore"][ws_all[0]]["gather_requests"] if "cachedstore" in by else 1
            ax.plot(ws_all, [base * w / ws_all[0] for w in ws_all], color="grey", linestyle=":",
                    label="O(W) reference")
            ax.plot(ws_all, [base * (w / ws_all[0]) ** 2 for w in ws_all], color="black",
                    linestyle=":", label="O(W²) reference")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers W")
        ax.set_ylabel("requests etcd served per round (its /metrics)")
        ax.set_title("All-gather + barrier: etcd requests per round")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "allgather_requests.png"), dpi=110)
        plt.close(fig)
        made.append("allgather_requests.png")

        fig, ax = plt.subplots(figsize=(11, 5))
        for name, pts in sorted(by.items()):
            ws = sorted(pts)
            ax.plot(ws, [pts[w]["wall_s"] * 1e3 for w in ws], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers W (processes on 2 cores)")
        ax.set_ylabel("wall time per round (ms)")
        ax.set_title("All-gather + barrier: wall time per round")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(os.path.join(plots_dir, "allgather_wall.png"), dpi=110)
        plt.close(fig)
        made.append("allgather_wall.png")
    return made


# --------------------------------------------------------------------------- markdown


def markdown(results: dict[str, Any], plot_files: list[str], elapsed: float | None) -> str:
    m = results.get("machine", {})
    v = m.get("versions", {})
    out = ["# Benchmark results", "",
           "Generated by `python benchmarks/run.py"
           + ("" if m.get("scale", {}).get("name") == "full" else " --quick")
           + "`; every figure below comes from that one run, all contenders measured side by "
           "side against the same etcd. Medians unless stated. Do not edit by hand: rerun.", "",
           "## Machine", "",
           table(["", ""], [
               ["date", str(m.get("date"))],
               ["CPU", f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB"],
               ["OS", str(m.get("os"))],
               ["load average (1, 5, 15 min), start → end",
                f"{results.get('loadavg_at_start')} → {m.get('loadavg_at_end')}"],
               ["Python", str(m.get("python"))],
               ["etcd", f"{m.get('etcd')} (single member, loopback, started with --enable-v2)"],
               ["torch", str(v.get("torch"))],
               ["libraries", ", ".join(f"{k} {x}" for k, x in v.items()
                                       if x and k != "torch")],
               ["scale", f"{m.get('scale', {}).get('name')}"
                + (f"; run time {elapsed:.0f} s" if elapsed else "")],
           ]), ""]
    for n in results.get("notes", []):
        out += [f"> Note: {n}", ""]
    out += ["## Targets", "", table(["target", "measured", ""], targets(results)), ""]

    # Hot key.
    h1, h8 = hot(results, 1), hot(results, 8)
    w8 = _w(results, "hot_key/8/")
    cached = h1.get("cachedstore cached")
    rows = []
    for name in sorted(h1, key=h1.get):
        rows.append([name, fmt_s(h1[name]), fmt_x(h1[name] / cached) if cached else "–",
                     fmt_s(h8.get(name)),
                     fmt_s(w8.get(name, {}).get("per_thread_latency_s")),
                     f"{w8[name]['throughput_per_s']:,.0f}" if name in w8 else "–"])
    out += ["## 1. Hot key: `get` of one cached key", "",
            "One process. *vs cached* = this contender's median / cachedstore's cached get. "
            "With 8 threads: process-wide time per get (wall / gets), what one thread waits "
            "per get, and gets per second. \"cachedstore uncached read\" is one gRPC Range "
            "through the store's own connection layer (the cost of a miss).", "",
            table(["contender", "1 thread", "vs cached", "8 threads, per get",
                   "8 threads, per thread", "8 threads, gets/s"], rows), ""]
    if "hot_key.png" in plot_files:
        out += ["![hot key](plots/hot_key.png)", ""]

    # mget.
    mg = _w(results, "mget/")
    sizes = sorted({x["n"] for x in mg.values()})
    contenders = sorted({x["contender"] for x in mg.values()})
    rows = []
    for c in contenders:
        rows.append([c] + [fmt_s(mg.get(f"{c}/{n}", {}).get("median_s")) for n in sizes])
    out += ["## 2. `mget` of N keys, cold and warm", "",
            "Cold: a fresh store (constructed outside the timing; no preload, so every key "
            "is read through from etcd). Warm: every key cached. "
            "TCPStore and etcd3 have no cache: every call goes to the server.", "",
            table(["contender"] + [f"N = {n:,}" for n in sizes], rows), ""]
    rt = results.get("workloads", {}).get("mget_round_trips")
    if rt:
        out += [f"Cold `mget(1000)` round trips: **{rt['store_total']}** counted by the store "
                f"(`cachedstore_etcd_requests_total`: {rt['store_counted']}), "
                f"**{rt['etcd_unary_total']}** unary requests counted by etcd "
                f"(`grpc_server_started_total`: {rt['etcd_counted']}); TCPStore's "
                f"`multi_get(1000)` is {rt['tcpstore_multi_get_requests']} request to its "
                "server. (A \"Watch msgs\" count is a store's periodic progress request on "
                "its watch stream, not part of the mget.)", ""]
    if "mget.png" in plot_files:
        out += ["![mget](plots/mget.png)", ""]

    # Coherence.
    co = _w(results, "coherence/")
    rows = []
    for name in sorted(co, key=lambda n: co[n]["p50_s"]):
        lag = co[name]["lag"]
        rows.append([name, str(lag["trials"]), fmt_s(lag["p50_s"]), fmt_s(lag["p90_s"]),
                     fmt_s(lag["p99_s"]), fmt_s(lag["max_s"])])
    out += ["## 3. Coherence lag and wake-up of blocked gets", "",
            "Another client (a raw etcd3 client; for TCPStore and torch v2 another client of "
            "the same kind) puts a fresh key; the time runs from just before that put to "
            "the moment the reader has the value.", "",
            table(["reader", "trials", "p50", "p90", "p99", "max"], rows), ""]
    b = co.get("cachedstore blocked get")
    if b:
        out += ["cachedstore blocked get, split by a timestamp taken when the store's watch "
                "thread hands the event to the cache: "
                f"etcd → watch delivery p50 {fmt_s(b['watch_delivery']['p50_s'])} / "
                f"p99 {fmt_s(b['watch_delivery']['p99_s'])}; cache → blocked thread running "
                f"p50 {fmt_s(b['wake_up']['p50_s'])} / p99 {fmt_s(b['wake_up']['p99_s'])}; "
                f"after the writer's put returned: p50 {fmt_s(b['after_put_ack']['p50_s'])} / "
                f"p99 {fmt_s(b['after_put_ack']['p99_s'])}.", ""]
    wc = results.get("workloads", {}).get("watch_cpu_per_event")
    if wc:
        out += [f"Watch cost: another process put {wc['events']:,} keys one by one (one watch "
                f"message each); this process spent **{fmt_s(wc['cpu_per_event_s'])} of CPU "
                f"per event** applying them ({wc['events_per_s']:,.0f} events/s absorbed): "
                f"{fmt_s(wc.get('watch_thread_cpu_per_event_s'))} in the store's watch thread, "
                f"of which {fmt_s(wc.get('handle_cpu_per_event_s'))} in the store's own "
                f"`Watcher._handle` (decode, revision gate, LRU insert, metrics), and "
                f"{fmt_s(wc.get('other_threads_cpu_per_event_s'))} in the other threads "
                f"(grpcio's channel-spin thread and event engine).", ""]
    if "coherence.png" in plot_files:
        out += ["![coherence](plots/coherence.png)", ""]

    # Fan-out.
    fo = _w(results, "fanout/")
    rows = []
    for name, x in sorted(fo.items()):
        rows.append([name, f"{x['threads']:,}", fmt_s(x["all_woken_s"]),
                     fmt_s(x["after_last_put_s"]), fmt_s(x["publish_s"])]
                    + ["–" if x[k] is None else f"{x[k]:,}" for k in (
                        "watch_streams_opened", "etcd_requests_blocking",
                        "etcd_requests_waking")])
    out += ["## 4. Fan-out: threads blocked on distinct keys, one writer", "",
            "*all woken*: writer's first put → last reader running; *after last put*: from "
            "the writer's last acknowledged put. etcd's counters: gRPC watch streams opened "
            "(the v2 API has no streams: each torch v2 waiter long-polls its own watch "
            "request instead), requests while the readers blocked (a cachedstore reader reads "
            "the key through once, unless its store preloaded the prefix and so knows the key "
            "is absent), and while they were woken.", "",
            table(["contender", "readers", "all woken", "after last put", "writer's puts",
                   "watch streams opened", "etcd requests, blocking", "etcd requests, waking"],
                  rows), ""]

    # All-gather.
    ag = _w(results, "allgather/")
    ws = sorted({x["world"] for x in ag.values()})
    contenders = sorted({x["contender"] for x in ag.values()})
    rows = []
    for w in ws:
        row = [str(w)]
        for c in contenders:
            x = ag.get(f"{c}/W{w}")
            if not x:
                row.append("–")
            elif x["etcd_requests"] is None:
                row.append(f"{fmt_s(x['wall_s'])}")
            else:
                row.append(f"{x['gather_requests']:.0f} + {x['barrier_requests']:.0f} = "
                           f"{x['etcd_requests']:.0f} req; {fmt_s(x['wall_s'])}")
        rows.append(row)
    out += ["## 5. All-gather + barrier across W processes", "",
            "Each cell: etcd requests per round for *gather* (write own key, read all W) + "
            "*barrier* (`add` to a counter, wait for \"done\") = total, as etcd counts them "
            "(unary gRPC + watch-stream messages + v2 HTTP), and the round's wall time. "
            "TCPStore has no etcd: wall time only. Store construction is not in the round "
            "(cachedstore: 2 requests per worker, once).", "",
            table(["W"] + contenders, rows), ""]
    sc = results.get("workloads", {}).get("allgather_scaling")
    if sc:
        rows = []
        for c, fit in sorted(sc["fits"].items()):
            rows.append([c] + [("–" if fit.get(k) is None else f"{fit[k]:.2f}")
                               for k in ("gather_requests", "barrier_requests",
                                         "etcd_requests", "wall_s")])
        out += ["Fitted exponents (least-squares slope on log-log axes, requests ∝ W^k):", "",
                table(["contender", "gather requests", "barrier requests", "round requests",
                       "round wall time"], rows), ""]
        rows = [[k] + [fmt_x(v.get(s)) for s in ("gather_requests", "barrier_requests",
                                                   "etcd_requests")]
                for k, v in sorted(sc.get("ratios", {}).items())]
        if rows:
            out += [table(["ratio of etcd requests", "gather", "barrier", "round"], rows), ""]
    for f in ("allgather_requests.png", "allgather_wall.png"):
        if f in plot_files:
            out += [f"![{f}](plots/{f})", ""]

    # Memory.
    mem = _w(results, "memory/")
    rows = []
    for _, x in sorted(mem.items(), key=lambda kv: kv[1]["value_size"]):
        rows.append([fmt_bytes(x["value_size"]), f"{x['entries']:,}",
                     f"{x['bytes_per_entry']:,.0f} B", f"{x['overhead_per_entry']:,.0f} B",
                     fmt_bytes(x["rss_per_100k_bytes"])])
    out += ["## 6. Memory per cached entry", "",
            "RSS of a fresh process measured at several fill levels of one store's cache "
            "(after `gc.collect()` and `malloc_trim`); the slope is the cost per entry, the "
            "overhead is that slope minus the value's own bytes.", "",
            table(["value size", "entries measured", "RSS per entry", "overhead per entry",
                   "RSS per 100,000 entries"], rows), ""]
    out += [ANALYSIS.format(**analysis_numbers(results))]
    return "\n".join(out)


def analysis_numbers(results: dict[str, Any]) -> dict[str, str]:
    """The few figures the analysis quotes, from this run."""
    w = results.get("workloads", {})
    h1, h8 = hot(results, 1), hot(results, 8)
    nums = {"gather_floor": "", "switch": "", "hit_split": "", "threads8": "–"}
    t16 = w.get("allgather/torch v2 EtcdStore/W16")
    gathers = [v["gather_by_method"] for k, v in w.items()
               if k.startswith("allgather/cachedstore/")]
    puts_only = bool(gathers) and all(set(g) == {"Put"} for g in gathers)
    if t16:
        nums["gather_floor"] = (f"At W = 16: 16 requests against torch v2's "
                                f"{t16['gather_requests']:.0f}, "
                                f"{fmt_x(t16['gather_requests'] / 16)}.")
    nums["gather_paragraph"] = (GATHER_PUTS if puts_only else GATHER_READS).format(**nums)
    nums["backoff"] = "see the table"
    fits = w.get("allgather_scaling", {}).get("fits", {})
    top = w.get("allgather_scaling", {}).get("top_world")
    plain = w.get(f"allgather/cachedstore/W{top}")
    proto = w.get(f"allgather/cachedstore, add with back-off (prototype)/W{top}")
    if plain and proto:
        k1 = fits.get("cachedstore", {}).get("barrier_requests")
        k2 = fits.get("cachedstore, add with back-off (prototype)", {}).get("barrier_requests")
        nums["backoff"] = (
            f"at W = {top} its barrier took {proto['barrier_requests']:.0f} requests against "
            f"{plain['barrier_requests']:.0f} with `add`"
            + (f" (exponents {k2:.2f} and {k1:.2f})" if k1 and k2 else ""))
    a = w.get("coherence/cachedstore polling get")
    b = w.get("coherence/cachedstore polling get, switch interval 0.5 ms")
    if a and b:
        nums["switch"] = (f"(p50 {fmt_s(a['p50_s'])} → {fmt_s(b['p50_s'])}, p99 "
                          f"{fmt_s(a['p99_s'])} → {fmt_s(b['p99_s'])})")
    on, off = h1.get("cachedstore cached"), h1.get("cachedstore cached, metrics=False")
    if on and off:
        nums["hit_split"] = (f"In this run metrics add {fmt_s(on - off)} to a "
                             f"{fmt_s(on)} hit (metrics=False: {fmt_s(off)}), about "
                             f"{(on - off) / on:.0%} of it.")
    parts = []
    for name, label in (("cachedstore cached", "metrics on"),
                        ("cachedstore cached, metrics=False", "metrics off"),
                        ("dict.get (Python floor)", "dict.get")):
        if name in h1 and name in h8:
            parts.append(f"{fmt_x(h8[name] / h1[name])} ({label})")
    if parts:
        nums["threads8"] = ", ".join(parts) + " versus one thread"
    return nums


GATHER_READS = """**≥ 10× fewer requests than torch v2 at W = 16.** torch's v2 store reads the whole
directory on every `get`, so its gather costs about W² reads; cachedstore's costs 2W
(W puts + one batched read per worker). The ratio therefore grows linearly with W and
crosses 10× between W = 16 and W = 32. The floor of cachedstore's 2W is the read-through
of keys not yet seen: a store cannot tell "absent" from "not cached yet" for a key its
watch has not mentioned, so each worker reads the missing keys once (one Txn, or one Range
when a single key is missing), and each `wait(["done"])` reads "done" once. A precise core
change that removes those reads in exactly the rendezvous case: the store already reads
`count_only` over its prefix when it starts its watch (`watcher.current_revision`); if
that count is 0 and, since then, the watch has stayed healthy, nothing has been evicted
and no resync happened, the cache holds every key under the prefix, so a miss is "absent
as of the applied revision" without asking etcd. The gather would then cost W requests
(the puts), and the barrier would lose its W "done" reads. (The general form is
Kubernetes' list-then-watch cache.) {gather_floor}"""

GATHER_PUTS = """**≥ 10× fewer requests than torch v2 at W = 16.** torch's v2 store reads the whole
directory on every `get`, so its gather costs about W² reads. cachedstore's gather costs
exactly W requests, the puts: each store loaded its (small) prefix when it started and has
evicted nothing since, so its cache is complete and a key it does not hold is known to be
absent as of the applied revision; `mget(…, timeout=…)` then waits for the watch without
reading etcd. The ratio grows linearly with W. {gather_floor}"""

ANALYSIS = """## Where targets are missed, and why

These notes explain mechanisms; the numbers they refer to are in the tables above.

**The barrier (`add` under contention).** The gather step is O(W) for cachedstore: exactly
one put per worker plus at most one batched read of the keys not yet delivered by its watch.
The `add` barrier is not: every worker `add`s to one counter, which is a compare-and-swap
Txn on the key's `mod_revision` (`cachedstore/store.py`, `EtcdStore.add`). When W workers
arrive together only one CAS per "generation" wins and the others retry with the value the
failed Txn returned, so the Txns per round grow towards W²/2 (see the Txn counts in the
barrier column and its exponent). torch's v2 store has the same problem (it sleeps a random
0–100 ms after every failed CAS). The row "cachedstore, add with back-off (prototype)" is a
benchmark-only increment in the manner of `add` (a CAS Txn, first guess from the store's
watch-fed cache) that sleeps a jittered 0.5 ms × 2^attempt (≤ 20 ms) after a failed CAS and
retries with the freshest value known: {backoff} — back-off trims retries
but does not make the barrier O(W). What does: a barrier that is another gather —
each worker sets its own arrival key and `wait`s for all W of them (row "cachedstore,
barrier by arrival keys", public API only), which is O(W) like the gather. A `barrier()`
helper built that way (or documentation of the pattern) would let users avoid the counter.

{gather_paragraph}

**All-gather wall time.** Every store watches the whole prefix, so with W workers each
write is delivered to W processes: about W × (W keys + W counter updates) watch messages
per round, all on 2 cores. The "watch cost" line in section 3 gives the CPU one process
spends per watch message, split by thread (from `/proc/self/task/*/stat`): most of it is
grpcio's streaming machinery (its channel-spin thread, its event engine, and the stream
iterator inside the watch thread); the store's own `Watcher._handle` is the smaller part.
So the round's wall time on 2 cores grows like W² × that per-message cost although the
etcd request count is O(W); spread over W hosts (the real deployment) it is W messages per
host. Trimming `_handle` would help little; fewer messages (the barrier by arrival keys
sends W instead of W counter updates plus retries) helps more, as its row shows.

**Coherence lag of a tight polling reader.** A thread that spins on `get` in pure Python
holds the GIL; the store's watch thread then waits up to `sys.getswitchinterval()` (5 ms by
default) for it at each of the hand-offs between gRPC's threads and the watch loop, so a
spinning reader sees the put several milliseconds later than a blocked reader does. The
same run with `sys.setswitchinterval(0.0005)` (row "switch interval 0.5 ms") shrinks the
lag {switch}, which pins the cause on the GIL, not on etcd or the cache. A blocked
`get(timeout=…)` or `wait()` releases the GIL and is woken by the watch directly: use
those, or sleep between polls.

**What a cache hit costs, and where a hot-path saving is.** The "Python floor" rows were
measured in the same run: a cachetools `LRUCache` lookup under a `threading.Lock` and one
prometheus-client `Counter.inc()` together make up most of a cached `get`
(`EtcdStore.get` → `CoherentCache.lookup` → `self._hit_get()`). {hit_split} A saving that
keeps exact counts: count hits in a plain integer inside `CoherentCache.lookup`, which
already holds the cache lock, and export it through a custom collector at scrape time —
this would remove the counter's own lock round trip per hit (not done here: it changes the
core hot path, and prometheus-client's multiprocess mode needs the regular counter). With 8
threads the process-wide cost per hit changes by {threads8}; threads preempted while holding
the cache lock (or the counter's) make the others queue for it, which a lock-free read of
the value (a GIL-atomic dict lookup, LRU recency updated approximately) would avoid.

**TCPStore client construction** on a machine without DNS spends ~150 ms per client in a
reverse lookup of its peer (`socket.cpp: The hostname of the client socket cannot be
retrieved`); that is why the TCPStore fan-out uses fewer readers. It does not affect the
per-`get` figures, which reuse connected clients. Across runs on this VM a TCPStore `get`
round trip has measured either ~12–17 µs or ~125 µs, for the in-process and the
other-process server alike (most likely the wake-up of an idle server thread on this VM,
not TCPStore's own work: the 8-thread rows, where the server stays busy, show ~15 µs per
get process-wide in every run); the table shows what this run saw.
"""


def build(results: dict[str, Any], out_md: str, plots_dir: str,
          elapsed: float | None = None) -> list[str]:
    made = plots(results, plots_dir)
    with open(out_md, "w") as f:
        f.write(markdown(results, made, elapsed))
    return made


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "out", "results.json")
    with open(path) as fh:
        data = json.load(fh)
    print(build(data, os.path.join(HERE, "RESULTS.md"), os.path.join(HERE, "plots")))
