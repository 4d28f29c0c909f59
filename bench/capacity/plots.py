"""The figures of bench-capacity (matplotlib, Agg): one 2 x 2 figure per temperature."""
from __future__ import annotations

from pathlib import Path

from specdec.bench.harness.plots import plt, save

COLOURS = {"batched": "tab:blue", "unbatched": "tab:orange", "edge-only": "tab:green"}


def _series(by_n: dict, key, sub: str | None = None):
    xs, ys = [], []
    for n in sorted(by_n, key=int):
        v = by_n[n].get(key) if sub is None else by_n[n].get(key, {}).get(sub)
        if isinstance(v, (int, float)):
            xs.append(int(n))
            ys.append(v)
    return xs, ys


def capacity_figure(table: dict, label: str, path: Path, note: str = "") -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.2))
    (a, b), (c, d) = axes
    for mode, by_n in table.items():
        col = COLOURS.get(mode, "black")
        a.plot(*_series(by_n, "aggregate_tps"), "o-", color=col, label=mode)
        b.plot(*_series(by_n, "per_device_p50"), "o-", color=col, label=f"{mode} p50")
        b.plot(*_series(by_n, "per_device_p95"), "s--", color=col, alpha=0.7, label=f"{mode} p95")
        c.plot(*_series(by_n, "ttft_p50"), "o-", color=col, label=f"{mode} p50")
        c.plot(*_series(by_n, "ttft_p95"), "s--", color=col, alpha=0.7, label=f"{mode} p95")
        xs, ys = _series(by_n, "batch", "mean_sessions")
        if xs:
            d.plot(xs, ys, "o-", color=col, label=f"{mode} sessions")
        xs, ys = _series(by_n, "batch", "mean_tokens")
        if xs:
            d.plot(xs, ys, "s--", color=col, alpha=0.7, label=f"{mode} tokens")
    titles = [(a, "aggregate tokens/s (all N busy)"), (b, "per-device tokens/s (p95 = slowest 5 %)"),
              (c, "time to first token (s)"), (d, "per target forward (edge /metrics)")]
    ns = sorted({int(n) for by_n in table.values() for n in by_n})
    for ax, title in titles:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("devices N")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "batch sizes unavailable\n(no specdec_edge_batch_* metrics)", ha="center",
                    va="center", transform=ax.transAxes, fontsize=8)
    fig.suptitle(f"bench-capacity {label}: one edge-server, N replayed devices", fontsize=10)
    return save(fig, path, note)


def all_plots(data: dict, out: Path) -> list[str]:
    s = data["settings"]
    note = (f"bench-capacity {data['started']}: {s['max_new_tokens']} tokens x "
            f"{s['sessions_per_client']} session(s) per device, {s['prompts']} prompts, "
            f"{s['repeats']} pass(es); rev {(data['git'].get('revision') or '')[:10]}"
            f"{' (dirty)' if data['git'].get('dirty') else ''}")
    return [capacity_figure(table, label, out / f"capacity_{label}.png", note).name
            for label, table in data["summary"].items()]
