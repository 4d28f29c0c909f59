"""From session records to bench-links' numbers: tokens/s per config and cell, the ratios, the
changing link's phases and rounds-to-recover, and the issue's five goals. Pure (no I/O).

Definitions:
  * tokens/s of a config in a cell = its generated tokens / its wall seconds, summed over the cell's
    sessions (prefill and Hello included, as a user sees them);
  * best fixed = the fixed configuration (not edge-only, not auto) with the most tokens/s in the cell;
  * the changing link: each config runs back-to-back sessions while the link changes at set times;
    a phase's tokens/s = tokens of the rounds that ended inside the phase / the phase's seconds
    (edge-only rounds stream: each token counts at its own arrival). The new link's best = the best
    non-auto config's tokens/s over that phase. Rounds to recover after a change = the least r such
    that auto's tokens/s from its r-th round after the change to the phase's end is >= RECOVER_SHARE x
    that best (0: it was there from the first round);
  * geometric mean of auto / default over the rate x RTT grid cells (both temperatures; the jitter
    and loss variants are reported beside it, not in it).
"""
from __future__ import annotations

import random
from collections import defaultdict

from specdec.bench.harness.analyze import Agg, geomean, goal, ratio
from specdec.bench.links.plan import CONFIGS, DEFAULT_CONFIG

RECOVER_SHARE = 0.95
GOALS = {
    "auto_vs_best_fixed": ("auto >= 0.95x the best fixed configuration, in every cell", 0.95),
    "auto_vs_default_geomean": ("auto >= 1.15x the fixed default (TSLT K=256 L=4), geometric mean over the grid", 1.15),
    "auto_vs_edge_only": ("auto never below 0.95x edge-only, in any cell", 0.95),
    "rounds_to_recover": ("after the link changes, within 5 rounds of the new link's best", 5),
    "auto_60ms_vs_0ms_10mbit": ("at 10 Mbit/s, auto at 60 ms RTT keeps >= 80% of its 0 ms tokens/s", 0.80),
}


def role(config: str) -> str:
    return CONFIGS[config][0] if config in CONFIGS else "fixed"


def config_stats(sessions: list[dict]) -> dict[str, dict]:
    """{config: {tokens, wall, sessions, tps, acceptance, up_bytes_per_token, up_bytes_per_draft_position}}
    over ``sessions`` (each {"config", "record"}); up_bytes: every round's uplink message, its settings
    and framing included."""
    by_config: dict[str, Agg] = {}
    for s in sessions:
        by_config.setdefault(s["config"], Agg()).add(s["record"], s.get("extra", {}))
    out = {}
    for name, a in by_config.items():
        out[name] = {"tokens": a.tokens, "wall": a.wall, "sessions": a.sessions, "up_bytes": a.up_bytes,
                     "accepted": a.accepted, "positions": a.positions, "tps": a.tps if a.wall > 0 else 0.0,
                     "acceptance": ratio(a.accepted, a.positions), "up_bytes_per_token": ratio(a.up_bytes, a.tokens),
                     "up_bytes_per_draft_position": ratio(a.up_bytes, a.positions)}
    return out


def cell_summary(stats: dict[str, dict]) -> dict:
    """Best fixed and the ratios of one cell from its config_stats."""
    tps = {name: v["tps"] for name, v in stats.items()}
    fixed = {n: t for n, t in tps.items() if role(n) == "fixed"}
    best = max(fixed, key=fixed.get) if fixed else None
    auto, none, default = tps.get("auto"), tps.get("none"), tps.get(DEFAULT_CONFIG)
    return {"tps": tps, "best_fixed": best, "best_fixed_tps": fixed.get(best),
            "auto_vs_best_fixed": ratio(auto, fixed.get(best)), "auto_vs_edge_only": ratio(auto, none),
            "auto_vs_default": ratio(auto, default), "best_fixed_vs_edge_only": ratio(fixed.get(best), none),
            "default_vs_best_fixed": ratio(default, fixed.get(best)), "default_vs_edge_only": ratio(default, none),
            "auto_vs_auto_nogumbel": ratio(auto, tps.get("auto-nogumbel")),
            "auto_vs_auto_free": ratio(auto, tps.get("auto-free"))}


BOOTSTRAP_DRAWS = 2000
INTERVAL = (0.05, 0.95)   # a 90 % interval


def auto_vs_best_interval(sessions: list[dict], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float] | None:
    """90 % bootstrap interval of a cell's auto / best fixed over its prompts: each draw takes prompts
    with replacement, the same ones for every config (they ran the same prompts and seeds), and
    recomputes the cell's summary (:func:`cell_summary`, so the best fixed is chosen again), so the
    interval also holds the upward pull of taking the best of several noisy configs. ``sessions``:
    {"config", "prompt", "record"} of one cell. None without auto, a fixed config, or two prompts.
    With few prompts the draws take few distinct values: a rough interval, but one the point
    estimate alone hides."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for s in sessions:
        by_prompt[s["prompt"]].append(s)
    prompts = sorted(p for p, group in by_prompt.items() if any(s["config"] == "auto" for s in group))
    if len(prompts) < 2 or not any(role(s["config"]) == "fixed" for s in sessions):
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        drawn = [s for _ in prompts for s in by_prompt[rng.choice(prompts)]]
        ratio = cell_summary(config_stats(drawn))["auto_vs_best_fixed"]
        if ratio:
            ratios.append(ratio)
    if not ratios:
        return None
    ratios.sort()
    return tuple(ratios[min(len(ratios) - 1, int(q * len(ratios)))] for q in INTERVAL)


# -- the changing link -----------------------------------------------------------------------------

def token_events(timeline: list[dict]) -> list[tuple[float, int]]:
    """(wall time, tokens) of each round's end; edge-only rounds per streamed token."""
    out = []
    for r in timeline:
        if r.get("token_t"):
            out += [(t, 1) for t in r["token_t"]]
        elif r["generated"]:
            out.append((r["t_wall"], r["generated"]))
    return out


def window_tps(events: list[tuple[float, int]], start: float, end: float) -> float | None:
    if end <= start:
        return None
    return sum(n for t, n in events if start < t <= end) / (end - start)


def rounds_to_recover(rounds: list[tuple[float, int]], change_t: float, end_t: float, target_tps: float,
                      share: float = RECOVER_SHARE) -> int | None:
    """Least r such that tokens/s over rounds r+1.. (after the change, up to end_t) >= share x target.

    ``rounds``: (end wall time, generated) of every round; the clock of the window starts at the
    change (r = 0) or at the end of the r-th round after it. None if never (or no rounds)."""
    after = [(t, n) for t, n in rounds if change_t < t <= end_t]
    for r in range(len(after)):
        start = change_t if r == 0 else after[r - 1][0]
        rest = after[r:]
        span = rest[-1][0] - start
        if span > 0 and sum(n for _, n in rest) / span >= share * target_tps:
            return r
    return None


def changing_summary(runs: dict[str, dict]) -> dict:
    """runs: {config: {"changes": [wall times of the phase starts, first = run start], "end": wall,
    "timeline": [rounds over all its sessions, in order]}} -> per-phase tokens/s of every config, the
    best non-auto per phase, and auto's rounds to recover after each change."""
    phases_tps: dict[str, list[float | None]] = {}
    for name, run in runs.items():
        bounds = list(run["changes"]) + [run["end"]]
        ev = token_events(run["timeline"])
        phases_tps[name] = [window_tps(ev, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    n_phases = max((len(v) for v in phases_tps.values()), default=0)
    best = []
    for i in range(n_phases):
        cands = {n: v[i] for n, v in phases_tps.items() if role(n) != "auto" and i < len(v) and v[i]}
        b = max(cands, key=cands.get) if cands else None
        best.append({"config": b, "tps": cands.get(b)})
    recover = []
    if "auto" in runs:
        run = runs["auto"]
        bounds = list(run["changes"]) + [run["end"]]
        rounds = [(r["t_wall"], r["generated"]) for r in run["timeline"]]
        for i in range(1, len(bounds) - 1):
            target = best[i]["tps"] if i < len(best) else None
            r = rounds_to_recover(rounds, bounds[i], bounds[i + 1], target) if target else None
            recover.append({"change": i, "rounds_to_recover": r, "target_tps": target,
                            "auto_tps": phases_tps["auto"][i] if i < len(phases_tps["auto"]) else None})
    return {"phase_tps": phases_tps, "phase_best": best, "recover": recover}


# -- goals -----------------------------------------------------------------------------------------

def goals(cells: dict[str, dict], changing: dict[str, dict]) -> dict[str, dict]:
    """cells: {cell name: {"link": {...Link}, "temperature", "summary": cell_summary}};
    changing: {temperature label: changing_summary}. Each goal: measured value, threshold, pass (None
    where auto did not run)."""
    def vals(key, kinds=("grid", "jitter", "loss")):
        return {n: c["summary"][key] for n, c in cells.items()
                if c["link"]["kind"] in kinds and c["summary"].get(key) is not None}

    out = {}
    best = vals("auto_vs_best_fixed")
    worst = min(best, key=best.get) if best else None
    out["auto_vs_best_fixed"] = {"value": best.get(worst), "where": worst}
    intervals = {n: cells[n]["summary"].get("auto_vs_best_fixed_interval") for n in best}
    if any(intervals.values()):
        threshold = GOALS["auto_vs_best_fixed"][1]
        out["auto_vs_best_fixed"]["below_even_at_interval_top"] = sorted(
            n for n, iv in intervals.items() if iv and iv[1] < threshold)
        out["auto_vs_best_fixed"]["below_but_within_interval"] = sorted(
            n for n, iv in intervals.items() if iv and best[n] < threshold <= iv[1])
    edge = vals("auto_vs_edge_only")
    worst = min(edge, key=edge.get) if edge else None
    out["auto_vs_edge_only"] = {"value": edge.get(worst), "where": worst}
    grid = vals("auto_vs_default", kinds=("grid",))
    variants = vals("auto_vs_default", kinds=("jitter", "loss"))
    out["auto_vs_default_geomean"] = {"value": geomean(list(grid.values())), "where": f"{len(grid)} grid cells",
                                      "variants_geomean": geomean(list(variants.values()))}
    rec = [r["rounds_to_recover"] for c in changing.values() for r in c.get("recover", [])]
    out["rounds_to_recover"] = {"value": (None if any(r is None for r in rec) else max(rec)) if rec else None,
                                "where": "worst change", "all": rec,
                                "never": sum(r is None for r in rec)}
    keep = {}
    for name, c in cells.items():
        link = c["link"]
        if link["kind"] == "grid" and link["up_mbit"] == 10.0 and link["rtt_ms"] == 60.0:
            zero = next((d for d in cells.values() if d["link"]["kind"] == "grid" and d["link"]["up_mbit"] == 10.0
                         and d["link"]["rtt_ms"] == 0.0 and d["temperature"] == c["temperature"]), None)
            if zero is not None:
                keep[name] = ratio(c["summary"]["tps"].get("auto"), zero["summary"]["tps"].get("auto"))
    keep = {k: v for k, v in keep.items() if v is not None}
    worst = min(keep, key=keep.get) if keep else None
    out["auto_60ms_vs_0ms_10mbit"] = {"value": keep.get(worst), "where": worst, "all": keep}
    with_gumbel = vals("auto_vs_auto_nogumbel")
    if with_gumbel:  # issue 37's A/B, where the run had auto-nogumbel: not one of issue 18's goals
        out["auto_vs_auto_nogumbel_geomean"] = {
            **goal("auto with gumbel >= 1.0x auto without it, geometric mean over the cells",
                   geomean(list(with_gumbel.values())), 1.0, f"{len(with_gumbel)} cells"), "all": with_gumbel}
    reproducible = vals("auto_vs_auto_free")
    if reproducible:  # issue 44's A/B, where the run had auto-free: the cost of same seed, same tokens
        out["auto_vs_auto_free_geomean"] = {
            **goal("seeded auto (same tokens every run) >= 0.95x auto free to choose any round, geometric "
                   "mean over the cells", geomean(list(reproducible.values())), 0.95,
                   f"{len(reproducible)} cells"), "all": reproducible}
    for key, (text, threshold) in GOALS.items():
        found = out[key]
        out[key] = {**found, **goal(text, found["value"], threshold, found["where"], found.get("detail"),
                                    at_most=key == "rounds_to_recover")}
    if out["rounds_to_recover"]["never"]:
        out["rounds_to_recover"]["pass"] = False  # a change auto never came back from
    return out
