"""The figures (matplotlib, Agg backend): each one a ratio or a curve from one run's tables."""
from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import NullFormatter

from specdec.bench.harness.plots import MODE_COLOURS, finite, plt, save

LOOPBACK_X_FACTOR = 10.0    # loopback sits one decade right of the fastest shaped rate
TSLT_SHADES = {32: "#9ecae1", 320: "#4292c6", 3200: "#08306b"}
CONFIG_ORDER = ["dense", "tslt-32", "tslt-320", "tslt-3200", "ksqs", "csqs", "dssd"]


def _colour(row: dict) -> str:
    if row.get("family") == "tslt" and row.get("K") in TSLT_SHADES:
        return TSLT_SHADES[row["K"]]
    return MODE_COLOURS.get(row.get("family"), "black")


NOTE = {"text": ""}  # provenance line under every figure (models, sample, machine), set by set_note


def set_note(text: str) -> None:
    NOTE["text"] = text


def _save(fig, path: Path) -> Path:
    return save(fig, path, NOTE["text"])


def topk_mass(curve: list[dict], vocab: int, drafter: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ks = [r["K"] for r in curve]
    ax.plot(ks, [r["mean"] for r in curve], "o-", color="tab:blue", ms=3, label="mean")
    ax.fill_between(ks, [r["p10"] for r in curve], [r["p90"] for r in curve], alpha=0.25, color="tab:blue",
                    label="10-90th percentile")
    for k in (32, 320, 3200):
        ax.axvline(k, color="grey", lw=0.7, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel(f"K (top-K of |V| = {vocab})")
    ax.set_ylabel("probability mass kept")
    steps = curve[0]["steps"] if curve else 0
    ax.set_title(f"Top-K mass of the drafter's q (TSLT Fig. 3)\n{drafter}, {steps} draft steps", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def acceptance_vs_k(rows: list[dict], vocab: int, path: Path) -> Path:
    """rows: shape, K (vocab for the untruncated reference), acceptance, acceptance_se, sigma_mean, ref."""
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    for shape, colour in (("chain", "tab:blue"), ("tree", "tab:orange")):
        pts = sorted((r for r in rows if r["shape"] == shape and finite(r["acceptance"])), key=lambda r: r["K"])
        if not pts:
            continue
        ks = [r["K"] for r in pts]
        a = [r["acceptance"] for r in pts]
        half = [1.96 * (r["acceptance_se"] or 0) for r in pts]
        yerr = [[min(x, h) for x, h in zip(a, half)], [min(1 - x, h) for x, h in zip(a, half)]]  # clip to [0, 1]
        ax.errorbar(ks, a, yerr=yerr,
                    fmt="o-", color=colour, ms=4, capsize=2, label=f"{shape}: measured alpha-hat (95% CI)")
        ref = pts[-1]["ref_acceptance"]
        trunc = [r for r in pts if r["K"] < vocab and finite(r["sigma_mean"])]
        if finite(ref) and trunc:
            kk = [r["K"] for r in trunc]
            lo = [max(0.0, ref - r["sigma_mean"]) for r in trunc]
            hi = [min(1.0, ref + r["sigma_mean"]) for r in trunc]
            ax.fill_between(kk, lo, hi, color=colour, alpha=0.15,
                            label=f"{shape}: alpha(K=|V|) +- E[sigma_K] (eq. 22)")
            ax.axhline(ref, color=colour, lw=0.7, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel(f"K (rightmost point: dense, K = |V| = {vocab})")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Acceptance vs K, and the bound |alpha-hat - alpha| <= E[sigma] (TSLT Fig. 4)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def speedup_vs_rate(rows: list[dict], ceilings: dict, path: Path) -> Path:
    """rows: one per (link, config) of the rate curve with rate_mbit (0 = loopback), speedup, predicted."""
    shaped = sorted({r["rate_mbit"] for r in rows if r["rate_mbit"] > 0})
    loop_x = (max(shaped) if shaped else 1.0) * LOOPBACK_X_FACTOR
    xpos = lambda rate: rate if rate > 0 else loop_x  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, shape in zip(axes, ("chain", "tree")):
        configs = sorted({r["config"] for r in rows if r["shape"] == shape},
                         key=lambda c: CONFIG_ORDER.index(c) if c in CONFIG_ORDER else len(CONFIG_ORDER))
        for name in configs:
            pts = sorted((r for r in rows if r["shape"] == shape and r["config"] == name),
                         key=lambda r: xpos(r["rate_mbit"]))
            colour = _colour(pts[0])
            xs = [xpos(r["rate_mbit"]) for r in pts]
            ax.plot(xs, [r["speedup"] for r in pts], "o-", color=colour, ms=4, label=f"{name} measured")
            for r in pts:
                if r.get("reduced"):
                    ax.plot(xpos(r["rate_mbit"]), r["speedup"], "o", ms=8, mfc="none", mec="black", mew=0.8)
            ax.plot(xs, [r["predicted_speedup"] for r in pts], "--", color=colour, lw=1, alpha=0.9)
        ax.axhline(1.0, color="black", lw=0.8)
        if shape == "chain" and finite(ceilings.get("assisted_speedup")):
            ax.axhline(ceilings["assisted_speedup"], color="tab:gray", lw=1.2, ls="-.",
                       label="HF assisted generation (one process)")
        ax.set_xscale("log")
        ticks = shaped + [loop_x]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in shaped] + ["loop-\nback"], fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("uplink rate (Mbit/s)")
        ax.set_title(f"{shape}" + (" <2,2,2> (TSLT Fig. 6)" if shape == "tree" else " L = draft_len (TSLT Fig. 5)"),
                     fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5, loc="upper left", ncol=2)
    axes[0].set_ylabel("speedup over the target alone")
    fig.suptitle("Speedup vs uplink rate: measured (solid) and oracle-call model from the same run (dashed);"
                 " circled = reduced sample", fontsize=9)
    return _save(fig, path)


def bytes_per_token(rows: list[dict], path: Path) -> Path:
    """rows: loopback points (grid configs): config, shape, uplink/downlink bytes per token."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['config']}\n{r['shape']}" for r in rows]
    xs = range(len(rows))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [r["uplink_bytes_per_token"] for r in rows], w, label="uplink (serialized)",
           color=[_colour(r) for r in rows])
    ax.bar([x + w / 2 for x in xs], [r["downlink_bytes_per_token"] for r in rows], w, label="downlink (serialized)",
           color="lightgray", edgecolor="gray")
    ax.scatter(list(xs), [r["theoretical_uplink_bits_per_token"] / 8 for r in rows], marker="_", s=200, color="black",
               zorder=3, label="uplink, papers' bit count / 8")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("bytes per generated token")
    ax.set_title("Uplink and downlink bytes per generated token (loopback sessions)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def sqs_fig2(rows: list[dict], link: str, budget_bits: int, lattice: int, path: Path) -> Path:
    """rows: mode (ksqs / csqs), temperature, seconds_per_token, resampling_rate."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for mode, colour in (("ksqs", "tab:green"), ("csqs", "tab:olive")):
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["temperature"])
        ts = [r["temperature"] for r in pts]
        label = "K-SQS" if mode == "ksqs" else "C-SQS"
        axes[0].plot(ts, [r["seconds_per_token"] for r in pts], "o-", color=colour, label=label)
        axes[1].plot(ts, [r["resampling_rate"] for r in pts], "o-", color=colour, label=label)
    axes[0].set_ylabel("latency (s per generated token)")
    axes[1].set_ylabel("resampling rate (rejected rounds / rounds)")
    axes[1].set_ylim(0, 1.05)
    for ax in axes:
        ax.set_xlabel("temperature T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"K-SQS vs C-SQS across temperatures (SQS Fig. 2), B = {budget_bits} bits, ell = {lattice}, "
                 f"uplink {link}", fontsize=9)
    return _save(fig, path)


def ceilings(c: dict, path: Path) -> Path:
    """Speedup over the target alone: HF assisted generation and ours on loopback per chain mode.

    Ratios, not raw tokens/s: each against a target-alone run adjacent in time (wall clock), or in
    CPU seconds (what the same work costs on quiet cores: other processes on the shared cores
    stretch wall time, not CPU time). Labels: ratio to HF assisted, wall clock; the speedup itself
    when HF assisted was not run (a drafter that is not a transformers model).
    """
    a = c["assisted_speedup"]
    assisted = finite(a) and a > 0
    bars = [("target alone", 1.0, 1.0, "black")]  # (name, wall, cpu, colour)
    if assisted:
        bars.append(("HF assisted\n(one process)", a, c.get("assisted_speedup_cpu"), "tab:gray"))
    bars += [(f"ours: {k}", v["speedup_vs_target"], v.get("speedup_cpu_vs_target"),
              MODE_COLOURS.get(v["family"], "tab:blue")) for k, v in c["ours"].items()]
    names, wall, cpu, colours = (list(col) for col in zip(*bars))
    fig, ax = plt.subplots(figsize=(8.5, 3.9))
    xs = list(range(len(wall)))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [v if finite(v) else 0 for v in wall], w, color=colours, label="wall clock")
    ax.bar([x + w / 2 for x in xs], [v if finite(v) else 0 for v in cpu], w, color=colours, alpha=0.45, hatch="//",
           label="CPU time")
    for x, v in zip(xs, wall):
        if finite(v):
            ax.text(x - w / 2, v, f"{v / a:.2f}x" if assisted else f"{v:.2f}x", ha="center", va="bottom",
                    fontsize=6.5)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("speedup over the target alone")
    ax.legend(fontsize=7)
    labels = "labels: ratio to HF assisted, wall" if assisted else "labels: speedup, wall"
    raw = f"HF assisted {c['assisted_tps']:.1f} tok/s " if assisted else "HF assisted not run (ceilings.json says why) "
    ax.set_title(f"Ceilings: same pair, L = {c.get('draft_len')}, same prompts and seeds ({labels})\n"
                 f"raw: target alone {c['target_tps']:.1f} tok/s, {raw}on {c.get('prompts')} prompt(s); target "
                 f"alone over the whole run: median {c.get('target_tps_run_median', float('nan')):.1f} tok/s",
                 fontsize=8)
    return _save(fig, path)
