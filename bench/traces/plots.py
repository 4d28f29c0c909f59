"""bench-traces figures: per trace, tokens/s over the trace's time under its capacity, with auto's
choice (mode, L, K) of every round."""
from __future__ import annotations

from pathlib import Path

from specdec.bench.harness.plots import MODE_COLOURS, plt, save
from specdec.bench.links.analyze import token_events
from specdec.testbed.traces import load_trace

WINDOW_S = 1.0        # tokens/s over a trailing window
CAPACITY_BIN_S = 0.1  # capacity shaded per bin


def _rate(events: list[tuple[float, int]], t0: float) -> tuple[list[float], list[float]]:
    """tokens/s over the trailing WINDOW_S (or since t0), at each arrival, x = seconds since t0."""
    xs, ys = [], []
    for i, (t, _) in enumerate(events):
        span = min(WINDOW_S, t - t0)
        if span > 0.05:
            xs.append(t - t0)
            ys.append(sum(n for u, n in events[: i + 1] if u > t - WINDOW_S) / span)
    return xs, ys


def trace_figure(trace: str, cells: list[dict], sessions: list[dict], path: Path, note: str = "") -> Path | None:
    """Rows: the trace's cells (round trip x temperature); columns: the session offsets."""
    mine = [s for s in sessions if s["trace"] == trace]
    offsets = sorted({s["offset_s"] for s in mine})
    if not mine or not cells:
        return None
    up, down = load_trace(mine[0]["up"]), load_trace(mine[0]["down"])
    fig, axes = plt.subplots(len(cells), len(offsets), figsize=(4.2 * len(offsets), 2.6 * len(cells)),
                             squeeze=False, sharey="row")
    for row, cell in zip(axes, cells):
        for ax, off in zip(row, offsets):
            here = [s for s in mine if s["cell"] == cell["name"] and s["offset_s"] == off]
            _panel(ax, here, up, down, off)
            ax.set_title(f"{cell['name']}, from {off:g} s", fontsize=7)
    axes[0][0].legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle(f"{trace}: tokens/s (trailing {WINDOW_S:g} s) under the trace's capacity\n(shaded, right axis: "
                 "uplink blue, downlink grey); auto's rounds along the top: colour = mode, label = L", fontsize=8)
    return save(fig, path, note)


def _panel(ax, sessions: list[dict], up, down, offset: float) -> None:
    end = max((s["extra"]["session_t1"] - s["applied_wall"] for s in sessions), default=5.0)
    cap = ax.twinx()
    n = max(1, int(end / CAPACITY_BIN_S) + 1)
    xs = [i * CAPACITY_BIN_S for i in range(n)]
    for trace, colour in ((down, "tab:gray"), (up, "tab:blue")):
        series = trace.capacity_series(offset, n * CAPACITY_BIN_S, CAPACITY_BIN_S)
        cap.fill_between(xs, [v / 1e6 for v in series], step="post", color=colour, alpha=0.15, lw=0)
    cap.set_ylabel("Mbit/s", fontsize=6)
    cap.tick_params(labelsize=6)
    top = 0.0
    for s in sorted(sessions, key=lambda s: s["config"]):
        xs_, ys = _rate(token_events(s["extra"]["timeline"]), s["applied_wall"])
        style = {"lw": 1.8, "color": "black", "zorder": 5} if s["config"] == "auto" else \
                {"lw": 1.0, "ls": "--", "color": "tab:gray"} if s["config"] == "none" else {"lw": 0.9}
        ax.plot(xs_, ys, label=s["config"], **style)
        top = max([top, *ys])
    for s in sessions:
        if s["config"] != "auto":
            continue
        for r in s["extra"]["timeline"]:
            x = r["t_wall"] - s["applied_wall"]
            ax.scatter(x, top * 1.08, s=9, color=MODE_COLOURS.get(r["mode"], "black"), zorder=6, clip_on=False)
            label = "0" if r["mode"] == "none" else str(r.get("draft_len", ""))
            ax.annotate(label, (x, top * 1.08), fontsize=4, xytext=(0, 3), textcoords="offset points", ha="center")
    ax.set_ylim(0, max(1.0, top * 1.2))
    ax.set_xlabel("seconds into the session", fontsize=6)
    ax.set_ylabel("tokens/s", fontsize=6)
    ax.tick_params(labelsize=6)


def regret_figure(regret: list[dict], path: Path, note: str = "") -> Path | None:
    """Per auto session, sorted: auto / the better of edge-only and the cell's best fixed, and auto /
    edge-only (the same prompt on the same stretch of the same cell), with the issue's lines."""
    if not regret:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("vs_better", "auto / better of edge-only and best fixed"), ("vs_edge_only", "auto / edge-only")):
        vals = sorted(r[key] for r in regret if r[key] is not None)
        if vals:
            ax.plot([(i + 0.5) / len(vals) for i in range(len(vals))], vals, marker=".", label=label)
    for y in (1.0, 0.97, 0.8):
        ax.axhline(y, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("share of auto sessions")
    ax.set_ylabel("tokens/s ratio (same cell, same prompt)")
    ax.set_title("mode auto per session: regret", fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, path, note)
