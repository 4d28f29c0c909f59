"""bench-links figures (matplotlib, Agg): ratio heat maps over rate x RTT, the changing link's series."""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.colors import TwoSlopeNorm

from specdec.bench.harness.plots import MODE_COLOURS, finite, plt, save


def heatmaps(cells: dict[str, dict], temperature: float, panels: list[tuple[str, str]], path: Path,
             note: str = "") -> Path | None:
    """One figure per temperature: one heat map per (summary key, title) over uplink rate x RTT."""
    grid = {(c["link"]["up_mbit"], c["link"]["rtt_ms"]): c["summary"] for c in cells.values()
            if c["link"]["kind"] == "grid" and c["temperature"] == temperature}
    if not grid:
        return None
    rates = sorted({r for r, _ in grid}, reverse=True)
    rtts = sorted({t for _, t in grid})
    ncols = 2 if len(panels) > 2 else len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        m = [[grid.get((r, t), {}).get(key) for t in rtts] for r in rates]
        vals = [v for row in m for v in row if finite(v)]
        data = [[v if finite(v) else math.nan for v in row] for row in m]
        lo, hi = (min(vals + [0.99]), max(vals + [1.01])) if vals else (0.5, 1.5)
        im = ax.imshow(data, cmap="RdYlGn", norm=TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01)))
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}" if finite(v) else "n/a", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(rtts)), [f"{t:g}" for t in rtts])
        ax.set_yticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("uplink (Mbit/s)")
        ax.set_title(f"{title}, T = {temperature:g}", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    return save(fig, path, note)


def _rolling(events: list[tuple[float, int]], t0: float, window_s: float) -> tuple[list[float], list[float]]:
    """tokens/s over a trailing window, sampled at each event."""
    xs, ys = [], []
    for i, (t, _) in enumerate(events):
        total = sum(n for u, n in events[: i + 1] if u > t - window_s)
        span = min(window_s, t - t0)
        if span > 0.2:
            xs.append(t - t0)
            ys.append(total / span)
    return xs, ys


def changing_series(runs: dict[str, dict], summary: dict, temperature: float, path: Path, events_of,
                    window_s: float = 2.0, note: str = "") -> Path | None:
    """tokens/s (trailing window) over time per config; auto's choice per round along the bottom."""
    if not runs:
        return None
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8.5, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, run in runs.items():
        t0 = run["changes"][0]
        xs, ys = _rolling(events_of(run["timeline"]), t0, window_s)
        style = {"lw": 2.2, "color": "black", "zorder": 5} if name == "auto" else \
                {"lw": 1.0, "ls": "--", "color": "tab:gray"} if name == "none" else {"lw": 0.9, "alpha": 0.8}
        ax.plot(xs, ys, label=name, **style)
    any_run = next(iter(runs.values()))
    for c in any_run["changes"][1:]:
        for a in (ax, ax2):
            a.axvline(c - any_run["changes"][0], color="red", lw=0.8, ls=":")
    for i, best in enumerate(summary.get("phase_best", [])):
        bounds = list(any_run["changes"]) + [any_run["end"]]
        if best.get("tps") and i + 1 < len(bounds):
            ax.hlines(best["tps"], bounds[i] - bounds[0], bounds[i + 1] - bounds[0], colors="tab:orange", lw=3,
                      alpha=0.4, label="best non-auto per phase" if i == 0 else None)
    ax.set_ylabel(f"tokens/s (trailing {window_s:g} s)")
    ax.set_title(f"Changing link 100 Mbit/s 5 ms -> 1 Mbit/s 100 ms -> back, T = {temperature:g}", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    auto = runs.get("auto")
    if auto:
        t0 = auto["changes"][0]
        seen = set()
        for r in auto["timeline"]:
            mode = r["mode"]
            colour = MODE_COLOURS.get(mode, "black")
            label = mode if mode not in seen else None
            seen.add(mode)
            ax2.scatter(r["t_wall"] - t0, r.get("draft_len", 0), s=10, color=colour, label=label)
            if mode in ("tslt", "ksqs") and r.get("top_k"):
                ax2.annotate(str(r["top_k"]), (r["t_wall"] - t0, r.get("draft_len", 0)), fontsize=5,
                             xytext=(0, 3), textcoords="offset points", ha="center")
        ax2.legend(fontsize=6, ncol=6, loc="upper right")
    ax2.set_ylabel("auto: L (K above)")
    ax2.set_xlabel("seconds since the run started")
    return save(fig, path, note)
