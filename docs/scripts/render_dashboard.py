"""Renders the Grafana dashboard's panels (charts/topoproxy/dashboards/
topoproxy.json) as one PNG, from real scrapes of the agents' /metrics.

Grafana draws time series from a Prometheus server; the guide has no server,
so each panel here shows what its queries show over a run: the counters'
totals from the end of it, the latency histogram as quantiles. The panel
titles are read from the dashboard, so the picture and the dashboard keep
the same names.

    render_dashboard.py OUT.png NODE.prom [NODE.prom ...]

Each file is one agent's /metrics text at the end of a run, named after its
node. Only the Python standard library and matplotlib.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "charts/topoproxy/dashboards/topoproxy.json"
TIERS = ["node", "zone", "region", "pool", "other"]
TIER_COLOURS = {"node": "#1a9850", "zone": "#91cf60", "region": "#fee08b", "pool": "#91bfdb", "other": "#d73027"}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts, as Prometheus does."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / max(c - prev_count, 1e-12))
        prev_bound, prev_count = b, c
    return prev_bound


def empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(argv[1])
    nodes = {pathlib.Path(p).stem: parse(pathlib.Path(p).read_text()) for p in argv[2:]}
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]

    fig, axes = plt.subplots(3, 2, figsize=(14, 12))
    fig.suptitle("topoproxy: topology and datapath (" + ", ".join(sorted(nodes)) + ")", fontsize=14)
    axes = axes.flatten()

    # 1. Connections by tier per Service, summed over the nodes.
    by_service: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for samples in nodes.values():
        for name, labels, value in samples:
            if name == "topoproxy_service_connections_total":
                svc = f'{labels.get("namespace", "")}/{labels.get("service", "")}'.strip("/") or "(without topology)"
                by_service[svc][labels.get("tier", "other")] += value
    ax = axes[0]
    ax.set_title(titles[0])
    if by_service:
        services = sorted(by_service)
        left = [0.0] * len(services)
        for tier in TIERS:
            widths = [by_service[s][tier] for s in services]
            ax.barh(services, widths, left=left, color=TIER_COLOURS[tier], label=tier)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel("connections")
        ax.legend(loc="lower right", fontsize=8)
    else:
        empty(ax, "no counted connections")

    # 2. Share kept in zone, per node: kept, what a blind pick would cross, avoided.
    ax = axes[1]
    ax.set_title(titles[1])
    rows = []
    for node, samples in sorted(nodes.items()):
        total = sum(v for n, _, v in samples if n == "topoproxy_service_connections_total")
        near = sum(v for n, l, v in samples if n == "topoproxy_service_connections_total" and l.get("tier") in ("node", "zone"))
        blind = sum(v for n, _, v in samples if n == "topoproxy_service_connections_blind_remote_total")
        if total:
            avoided = 1 - (total - near) / blind if blind else float("nan")
            rows.append((node, near / total, blind / total, avoided))
    if rows:
        xs = range(len(rows))
        w = 0.27
        series = [
            ([x - w for x in xs], [r[1] for r in rows], "kept in zone", "#1a9850"),
            (list(xs), [r[2] for r in rows], "a topology-blind pick would have crossed", "#d73027"),
            # Negative where topology crossed more than a blind pick would
            # (a node-pool Service whose pool spans zones).
            ([x + w for x in xs], [0 if math.isnan(r[3]) else r[3] for r in rows], "crossings avoided", "#4575b4"),
        ]
        for pos, values, label, colour in series:
            bars = ax.bar(pos, values, w, label=label, color=colour)
            ax.bar_label(bars, labels=[f"{v:.0%}" for v in values], fontsize=7)
        ax.axhline(0, color="#333333", linewidth=0.8)
        ax.set_xticks(list(xs), [r[0] for r in rows])
        ax.set_ylim(min(0.0, *series[2][1]) - 0.1, 1.15)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.legend(loc="upper right", fontsize=7)
    else:
        empty(ax, "no counted connections")

    # 3. Programming latency: p50 and p99 per node from the histogram. It
    # needs the objects' trigger times, which only the API server gives
    # (EndpointSlices' last-change annotation); from manifests, the sync's
    # own duration stands in, and the panel says so.
    ax = axes[2]
    ax.set_title(titles[2])

    def latencies(family: str) -> list[tuple[str, float, float]]:
        out = []
        for node, samples in sorted(nodes.items()):
            buckets: dict[float, float] = defaultdict(float)
            for n, l, v in samples:
                if n == family:
                    buckets[float(l["le"].replace("+Inf", "inf"))] += v
            p50, p99 = quantile(0.5, buckets), quantile(0.99, buckets)
            if p50 is not None:
                out.append((node, p50 * 1000, p99 * 1000))
        return out

    lat = latencies("topoproxy_network_programming_duration_seconds_bucket")
    if not lat:
        lat = latencies("topoproxy_sync_duration_seconds_bucket")
        if lat:
            ax.set_title(titles[2] + " (sync duration: no trigger times from manifests)", fontsize=10)
    if lat:
        xs = range(len(lat))
        ax.bar([x - 0.2 for x in xs], [r[1] for r in lat], 0.4, label="p50", color="#91bfdb")
        ax.bar([x + 0.2 for x in xs], [r[2] for r in lat], 0.4, label="p99", color="#4575b4")
        ax.set_xticks(list(xs), [r[0] for r in lat])
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    else:
        empty(ax, "no programming latency recorded")

    def by_reason(ax, title, families, filt=None):
        ax.set_title(title)
        counts: dict[str, float] = defaultdict(float)
        for samples in nodes.values():
            for n, l, v in samples:
                if n in families and (filt is None or l.get("reason") in filt):
                    key = families[n] + " " + " ".join(x for x in (l.get("protocol", ""), l.get("reason", "")) if x)
                    counts[key.strip()] += v
        counts = {k: v for k, v in counts.items() if v > 0}
        if counts:
            keys = sorted(counts)
            ax.barh(keys, [counts[k] for k in keys], color="#fc8d59")
        else:
            empty(ax, "none in this run")

    # 4. Sockets terminated by reason.
    by_reason(axes[3], titles[3], {"topoproxy_sockets_terminated_total": "sockets", "topoproxy_conntrack_flushed_flows_total": "NodePort flows"})

    # 5. Map occupancy: the fullest node's entries over capacity, per map.
    ax = axes[4]
    ax.set_title(titles[4])
    occ: dict[str, float] = {}
    for samples in nodes.values():
        entries = {l.get("map"): v for n, l, v in samples if n == "topoproxy_map_entries"}
        capacity = {l.get("map"): v for n, l, v in samples if n == "topoproxy_map_capacity"}
        for m, e in entries.items():
            if capacity.get(m):
                occ[m] = max(occ.get(m, 0.0), e / capacity[m])
    if occ:
        keys = sorted(occ)
        bars = ax.barh(keys, [occ[k] for k in keys], color="#91bfdb")
        ax.bar_label(bars, labels=[f"{occ[k]:.2%}" for k in keys], fontsize=7, padding=3)
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    else:
        empty(ax, "no map figures")

    # 6. Datapath drops by reason.
    by_reason(
        axes[5],
        titles[5],
        {"topoproxy_socket_lb_calls_total": "connect", "topoproxy_nodeport_packets_total": "NodePort"},
        {"refused_no_backend", "refused_source_range", "rejected_no_backend", "dropped_no_local", "dropped_source_range"},
    )

    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out} from {len(nodes)} scrapes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
