"""The check's one figure (matplotlib, Agg): a row per model, four panels each."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = (("batched", "tab:blue"), ("unbatched", "tab:red"), ("edge-only", "tab:green"))


def figure(data: dict, path: Path) -> Path:
    models = [m for m in data["models"] if "cost" in m]
    rows = max(1, len(models))
    fig, axes = plt.subplots(rows, 4, figsize=(22, 4.2 * rows), squeeze=False)
    for row, m in zip(axes, models):
        _cost_t(row[0], m)
        _cost_b(row[1], m)
        _capacity(row[2], m)
        _phases(row[3], m)
    fig.suptitle(f"gpu-check on {data['machine'].get('device_name', '?')} "
                 f"({data['settings']['dtype']}; {data['started']})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _legend(ax, size: int) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=size)


def _ms(d: dict) -> tuple[list[int], list[float]]:
    xs = sorted(int(k) for k in d)
    return xs, [1e3 * d[k] if k in d else 1e3 * d[str(k)] for k in xs]


def _cost_t(ax, m: dict) -> None:
    for context, curve in m["cost"]["slots"].items():
        xs, ys = _ms(curve["T"])
        ax.plot(xs, ys, marker="o", label=f"context {context}")
    floor = m.get("floor_s")
    if floor:
        ax.axhline(1e3 * floor, color="k", ls="--", label="weight-read floor")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{m['name']}: one session, T new tokens")
    ax.set_xlabel("T")
    ax.set_ylabel("ms per forward")
    _legend(ax, 7)


def _cost_b(ax, m: dict) -> None:
    for layout, style in (("slots", "-"), ("per-session", ":")):
        for context, curve in m["cost"][layout].items():
            for length, by_b in curve["BxL"].items():
                xs, ys = _ms(by_b)
                ax.plot(xs, ys, style, marker=".", label=f"{layout}, ctx {context}, L {length}")
    ax.set_xscale("log", base=2)
    ax.set_title("B sessions x L tokens")
    ax.set_xlabel("B")
    ax.set_ylabel("ms per forward")
    _legend(ax, 6)


def _capacity(ax, m: dict) -> None:
    cells = [c for c in m.get("capacity", {}).get("cells", []) if "stats" in c and not c.get("edge")]  # no A/B arm
    for mode, color in MODES:
        alphas = sorted({c["alpha"] for c in cells if c["mode"] == mode}, key=lambda a: -1 if a is None else a)
        for a, style in zip(alphas, ("-", "--")):
            pts = sorted((c["n"], c["stats"].get("aggregate_tps") or 0.0) for c in cells
                         if c["mode"] == mode and c["alpha"] == a)
            if pts:
                ax.plot(*zip(*pts), style, color=color, marker="o",
                        label=mode + (f" a={a}" if a is not None else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("capacity (replayed devices, real edge-server)")
    ax.set_xlabel("devices N")
    ax.set_ylabel("aggregate tokens/s")
    _legend(ax, 7)


PIPELINE = ("inputs", "copy", "forward", "append", "logits")
COLORS = {"inputs": "tab:gray", "copy": "tab:orange", "forward": "tab:blue", "append": "tab:red",
          "logits": "tab:purple", "verify": "tab:green"}


def _phases(ax, m: dict) -> None:
    """Per layout, the round with its verification batched on the device and, beside it, session by
    session on the device and on the host (T = 0)."""
    bars = [(f"{layout}\n{place} verify", d, f"verify_{place}_T0") for layout, d in m.get("phases", {}).items()
            for place in ("batched", "device", "host") if f"verify_{place}_T0" in d]
    for i, (_, d, verify) in enumerate(bars):
        bottom = 0.0
        for name in (*PIPELINE, "verify"):
            v = 1e3 * d.get(verify if name == "verify" else name, 0.0)
            ax.bar(i, v, bottom=bottom, color=COLORS[name], label=name if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("one batched round (T = 0), ms per phase")
    _legend(ax, 6)
