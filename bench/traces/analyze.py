"""From session records to bench-traces' numbers: per configuration and cell tokens/s, time to first
token, the gaps between streamed tokens and bytes per token; the ratios and the issue's goals. Pure.

Definitions:
  * tokens/s of a configuration over some sessions = their generated tokens / their wall seconds, a
    session's from before its Hello to its last token on the device (the record's own wall time starts
    after the Welcome: a recorded outage met while connecting would go uncounted for one configuration
    and count for another that met it in a round);
  * time to first token (TTFT) = from the session's start on the device (before its Hello) to the
    arrival of its first token;
  * a gap between streamed tokens = the time from one arrival of tokens to the next (a verdict's
    tokens arrive at once: one arrival; edge-only rounds stream, each token its own arrival): how
    long the text stands still, what a user feels as stutter; p50 / p95 / max over the gaps of the
    sessions pooled (the first token's wait is the TTFT, not a gap);
  * the links grid's best fixed = the one fixed configuration run here beside the default (the one
    best in most cells of the committed links run); ratios compare auto with it, with edge-only
    (mode none) and with the default;
  * per (trace, temperature): a ratio's geometric mean over the round trips, and the p95 gap over the
    sessions of both round trips pooled;
  * the host's noise (an A/A comparison, free): auto sessions whose rounds were all edge-only rounds
    did what edge-only did on the same prompt and stretch of the link, so their tokens/s against
    edge-only's differ only by the host (two processes on shared cores, a target forward whose time
    moves between sessions); the spread of that ratio over such pairs says how far a cell's ratio of
    k prompts moves with no difference between the configurations: sd / sqrt(k); and where the pairs'
    time went: auto's time to first token and median gap between streamed tokens against edge-only's,
    and what its round boundaries (an edge-only round asks for a chunk of tokens; edge-only streams
    one round) cost beyond a streamed gap: what auto's edge-only rounds would lose by their own doing;
  * the control (``--control``, a diagnostic): edge-only run a second time in each cell (CONTROL), on
    the same prompts, seeds and stretches of the link as the first, its order balanced with the others:
    the same tokens the same way, so its ratio to edge-only is the host alone, measured in the run it
    qualifies rather than inferred from auto's edge-only sessions (which carry auto's own round
    boundaries, and exist only where auto chose edge-only); issue 46's goals against edge-only, judged
    with the control in auto's place, say whether a goal at that precision can be told from the host's
    noise at all in this run;
  * host slowdowns (a diagnostic): sessions whose edge-only tokens streamed SLOW_STREAM times the run's
    median gap or slower (each session's median gap between streamed tokens, over sessions with
    MIN_STREAMED_GAPS or more): a target forward takes the same time in every configuration, so a
    session that streamed that slowly met a host that slowed it (another tenant of the machine), and
    whichever configuration ran then paid for it;
  * a prompt split at the finish line (a diagnostic; the goals are judged on every prompt): an outage of
    the recording (no delivery opportunity for FINISH_LINE_OUTAGE_S or longer, either direction) began
    after some of the prompt's sessions had ended and before others did, so those met a stall the
    others never saw: the cell compares how close each configuration came to a fixed point of the
    recording, not how fast it streams. The cell's ratios over its other prompts say what is left.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from specdec.bench.harness.analyze import geomean, goal, percentile, ratio
from specdec.bench.links.analyze import token_events

# Issue 46's goals: auto judged where speculation barely pays or does not pay (held-out links, slow drafters)
NEVER_LOSES_GOALS = {
    "auto_vs_edge_only_every_cell": ("auto >= 0.97x edge-only on every cell", 0.97),
    "auto_vs_cell_best_fixed_every_cell": ("auto >= 0.9x the cell's best fixed on every cell", 0.9),
    "auto_session_vs_edge_only": ("no auto session below 0.8x edge-only (same prompt, cell)", 0.8),
}
# A stall this long is ~9 % of a 96-token session at the held-out cells' ~17 tok/s: as much as the goals'
# tolerance against the best fixed setting, so a prompt that only some configurations finished before one
# began says where the finish line fell, not which configuration streams faster.
FINISH_LINE_OUTAGE_S = 0.5
# A session's median gap between streamed tokens this far above the run's: the host slowed it. The median
# gap moves 2-5 % between a quiet host's sessions; a link stall moves a session's gaps, not its median.
SLOW_STREAM = 1.2
MIN_STREAMED_GAPS = 20  # gaps a session's median needs to say how it streamed
CONTROL = "edge-only-again"  # the control's configuration (links.plan.CONFIGS: edge-only, run again)
GOALS = {
    "auto_vs_best_geomean": ("auto >= 1.0x the links grid's best fixed, geometric mean over traces and round trips", 1.0),
    "auto_vs_best_every_trace": ("auto >= 0.95x the links grid's best fixed on every trace", 0.95),
    "auto_vs_edge_only": ("auto >= 1.5x edge-only on every LTE trace", 1.5),
    "auto_p95_gap_vs_best": ("auto's p95 gap between streamed tokens / the best fixed's, on every trace", 1.0),
}


def session_metrics(sess: dict) -> dict:
    """One session's tokens, wall, TTFT, token gaps and bytes (from its record and timeline)."""
    st, extra = sess["record"]["stats"], sess["extra"]
    arrivals = sorted(t for t, _ in token_events(extra.get("timeline", [])))
    t0 = extra.get("session_t0")
    t1 = extra.get("session_t1")
    wall = t1 - t0 if t0 is not None and t1 is not None else st["wall_seconds"]
    return {"tokens": st["generated_tokens"], "wall": wall, "device_cpu": extra.get("device_cpu_s"),
            "ttft": arrivals[0] - t0 if arrivals and t0 is not None else None,
            # the session's end after its last token: the stream's close (a drafted last round waits a
            # round trip for the edge's status; an edge-only one sent its Close with its first token)
            "end_wait": t1 - arrivals[-1] if arrivals and t1 is not None else None,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "up_bytes": st["uplink_bytes"], "down_bytes": st["downlink_bytes"]}


def config_stats(sessions: list[dict]) -> dict[str, dict]:
    """{config: tokens/s, TTFT (mean, max), gap p50/p95/max, bytes per token up/down, the wait after the
    last token p50/max, sessions}."""
    by: dict[str, list[dict]] = defaultdict(list)
    for s in sessions:
        by[s["config"]].append(session_metrics(s))
    out = {}
    for name, ms in by.items():
        tokens, wall = sum(m["tokens"] for m in ms), sum(m["wall"] for m in ms)
        gaps = [g for m in ms for g in m["gaps"]]
        ttfts = [m["ttft"] for m in ms if m["ttft"] is not None]
        cpu = [(m["device_cpu"], m["tokens"]) for m in ms if m["device_cpu"] is not None]
        ends = [m["end_wait"] for m in ms if m["end_wait"] is not None]
        out[name] = {"end_wait_p50": percentile(ends, 50), "end_wait_max": max(ends, default=None),
                     "sessions": len(ms), "tokens": tokens, "wall": wall, "tps": ratio(tokens, wall),
                     "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None, "ttft_max": max(ttfts, default=None),
                     "gap_p50": percentile(gaps, 50), "gap_p95": percentile(gaps, 95), "gap_max": max(gaps, default=None),
                     "up_bytes_per_token": ratio(sum(m["up_bytes"] for m in ms), tokens),
                     "down_bytes_per_token": ratio(sum(m["down_bytes"] for m in ms), tokens),
                     "device_cpu_per_token": ratio(sum(c for c, _ in cpu), sum(n for _, n in cpu))}
    return out


def cell_summary(stats: dict[str, dict], best_fixed: str, default: str) -> dict:
    tps = {n: v["tps"] for n, v in stats.items()}
    auto = tps.get("auto")
    fixed = {n: v for n, v in tps.items() if n not in ("auto", "none", CONTROL) and v is not None}
    cell_best = max(fixed, key=fixed.get) if fixed else None
    return {"tps": tps, "auto_vs_best_fixed": ratio(auto, tps.get(best_fixed)),
            "control_vs_edge_only": ratio(tps.get(CONTROL), tps.get("none")),
            "auto_vs_both_edge_only": ratio(auto, _pooled_tps(stats, ("none", CONTROL))),
            "auto_vs_edge_only": ratio(auto, tps.get("none")), "auto_vs_default": ratio(auto, tps.get(default)),
            "best_fixed_vs_edge_only": ratio(tps.get(best_fixed), tps.get("none")),
            "cell_best_fixed": cell_best, "auto_vs_cell_best_fixed": ratio(auto, fixed.get(cell_best))}


def _pooled_tps(stats: dict[str, dict], configs: tuple[str, ...]) -> float | None:
    """Tokens/s of ``configs``' sessions pooled, None unless every one ran (edge-only's two runs, with
    the control: a baseline whose host noise is averaged over twice the sessions)."""
    if not all(stats.get(c) for c in configs):
        return None
    return ratio(sum(stats[c]["tokens"] for c in configs), sum(stats[c]["wall"] for c in configs))


def _tps(sess: dict) -> float | None:
    m = session_metrics(sess)
    return ratio(m["tokens"], m["wall"])


def tps_by_session(sessions: list[dict]) -> dict[tuple, float | None]:
    """{(cell, config, prompt): tokens/s}: what a session is compared with on the same prompt and cell."""
    return {(s["cell"], s["config"], s["prompt"]): _tps(s) for s in sessions}


def vs_edge_only(tps: dict[tuple, float | None], sess: dict) -> float | None:
    """``sess``'s tokens/s over edge-only's on the same cell and prompt (``tps``: :func:`tps_by_session`)."""
    return ratio(tps[(sess["cell"], sess["config"], sess["prompt"])], tps.get((sess["cell"], "none", sess["prompt"])))


def session_regret(cells: dict[str, dict], sessions: list[dict]) -> list[dict]:
    """Per auto session: its tokens/s against edge-only's and the cell's best fixed setting's on the same
    prompt and stretch of the link (same cell, same prompt), and against the better of the two."""
    tps = tps_by_session(sessions)
    out = []
    for s in sessions:
        if s["config"] != "auto":
            continue
        cell, p = s["cell"], s["prompt"]
        auto, edge = tps[(cell, "auto", p)], tps.get((cell, "none", p))
        best = tps.get((cell, cells.get(cell, {}).get("summary", {}).get("cell_best_fixed"), p))
        better = max((v for v in (edge, best) if v is not None), default=None)
        out.append({"cell": cell, "prompt": p, "auto": auto, "vs_edge_only": ratio(auto, edge),
                    "vs_best_fixed": ratio(auto, best), "vs_better": ratio(auto, better)})
    return out


def regret_summary(regret: list[dict]) -> dict:
    """p5 / p50 / p95 over sessions of auto against the better of edge-only and the cell's best fixed,
    and against edge-only; the worst session."""
    out = {}
    for key in ("vs_better", "vs_edge_only", "vs_best_fixed"):
        vals = [r[key] for r in regret if r[key] is not None]
        out[key] = {"p5": percentile(vals, 5), "p50": percentile(vals, 50), "p95": percentile(vals, 95),
                    "min": min(vals, default=None), "sessions": len(vals)}
    return out


def edge_only_rounds_only(sess: dict) -> bool:
    """The session's rounds were all edge-only rounds (its timeline says so; False without one)."""
    timeline = sess.get("extra", {}).get("timeline") or []
    return bool(timeline) and all(r.get("mode") == "none" for r in timeline)


def aa_pairs(sessions: list[dict]) -> list[tuple[dict, dict]]:
    """(auto session, edge-only session) on the same cell and prompt, for each auto session whose rounds
    were all edge-only rounds: the A/A pairs (see the module's docstring)."""
    edge_only = {(s["cell"], s["prompt"]): s for s in sessions if s["config"] == "none"}
    return [(s, edge_only[(s["cell"], s["prompt"])]) for s in sessions
            if s["config"] == "auto" and edge_only_rounds_only(s) and (s["cell"], s["prompt"]) in edge_only]


def host_noise(sessions: list[dict], prompts: int) -> dict:
    """The A/A comparison (see the module's docstring): over auto sessions that ran edge-only rounds
    only, their tokens/s / edge-only's on the same cell and prompt: the pairs, the ratios' geometric
    mean and the standard deviation of their logs (per session), and that over sqrt(``prompts``): how
    far a cell's ratio moves with the host alone (one standard deviation); and :func:`aa_split`."""
    pairs = aa_pairs(sessions)
    logs = []
    for auto, edge_only in pairs:
        r = ratio(_tps(auto), _tps(edge_only))
        if r is not None and r > 0:
            logs.append(math.log(r))
    split = aa_split(pairs)
    if len(logs) < 2:
        return {"pairs": len(logs), "geomean": None, "sd": None, "cell_sd": None, "split": split}
    sd = statistics.stdev(logs)
    return {"pairs": len(logs), "geomean": math.exp(statistics.fmean(logs)), "sd": sd,
            "cell_sd": sd / math.sqrt(max(1, prompts)), "split": split}


def aa_split(pairs: list[tuple[dict, dict]]) -> dict:
    """Where the A/A pairs' time went (see the module's docstring), over the pairs whose sessions both
    streamed: auto's time to first token / edge-only's and its median gap between streamed tokens /
    edge-only's (geometric means), and what auto's round boundaries cost: each boundary's gap (the
    last token of a round to the first of the next) less the session's median gap, summed per session,
    as a share of the session's wall (mean over the pairs; edge-only's one round has no boundary)."""
    ttft, gap, boundary, boundaries = [], [], [], []
    for auto, edge_only in pairs:
        mine, theirs = session_metrics(auto), session_metrics(edge_only)
        a, b = _streamed_gaps(auto), _streamed_gaps(edge_only)
        if not (a and b) or not all(t is not None and t > 0 for t in (mine["ttft"], theirs["ttft"])):
            continue  # no stream, or no first token timed
        streamed = statistics.median(a)
        ttft.append(mine["ttft"] / theirs["ttft"])
        gap.append(streamed / statistics.median(b))
        edges = _boundary_gaps(auto)
        boundaries.append(len(edges))
        boundary.append(sum(g - streamed for g in edges) / mine["wall"])
    return {"pairs": len(ttft), "ttft_ratio": geomean(ttft), "gap_ratio": geomean(gap),
            "boundaries_mean": statistics.fmean(boundaries) if boundaries else None,
            "boundary_share": statistics.fmean(boundary) if boundary else None}


def _boundary_gaps(sess: dict) -> list[float]:
    """Seconds from each round's last streamed token to the next round's first."""
    rounds = [r["token_t"] for r in sess.get("extra", {}).get("timeline") or [] if r.get("token_t")]
    return [b[0] - a[-1] for a, b in zip(rounds, rounds[1:])]


def _streamed_gaps(sess: dict) -> list[float]:
    """Seconds between consecutive tokens of the session's edge-only rounds, within each round (not
    :func:`session_metrics`' gaps: a drafted round's verdict is one arrival of several tokens, and the
    wait between rounds is not how the edge streams)."""
    gaps: list[float] = []
    for r in sess.get("extra", {}).get("timeline") or []:
        tokens = r.get("token_t") or []
        gaps += [b - a for a, b in zip(tokens, tokens[1:])]
    return gaps


def host_slowdowns(sessions: list[dict]) -> dict:
    """Sessions that streamed SLOW_STREAM times the run's median gap or slower (see the module's
    docstring): the run's median (ms; None with no session to judge by) and, for each such session in
    start order, its start (seconds after the run's first session), cell, prompt, configuration and median
    gap (ms)."""
    medians = []
    for s in sessions:
        gaps = _streamed_gaps(s)
        if len(gaps) >= MIN_STREAMED_GAPS:
            medians.append((s["extra"].get("session_t0", 0.0), s, statistics.median(gaps)))
    if not medians:
        return {"median_gap_ms": None, "slowed": []}
    run = statistics.median(m for _, _, m in medians)
    t0 = min(t for t, _, _ in medians)
    slowed = [{"t_s": t - t0, "cell": s["cell"], "prompt": s["prompt"], "config": s["config"], "median_gap_ms": 1e3 * m}
              for t, s, m in sorted(medians, key=lambda x: x[0]) if m >= SLOW_STREAM * run]
    return {"median_gap_ms": 1e3 * run, "slowed": slowed}


def control_goals(cells: dict[str, dict], sessions: list[dict]) -> dict:
    """Issue 46's goals against edge-only judged with the control (CONTROL: edge-only run again) in
    auto's place: the host alone against the goals' precision (see the module's docstring). Also the
    spread of the control's session ratios: the per-session standard deviation of their logs, and that
    over the root of a cell's prompts (one cell's ratio moves that much, 1 sd, with no difference at
    all); and auto against edge-only's two runs pooled (a baseline with half the host's variance:
    a diagnostic beside the goal, which stays judged against the first run). Empty where the run had
    no control."""
    cell_ratios = {k: c["summary"].get("control_vs_edge_only") for k, c in cells.items()}
    if all(v is None for v in cell_ratios.values()):
        return {}
    tps = tps_by_session(sessions)
    per_session = {f"{s['cell']} p{s['prompt']}": vs_edge_only(tps, s) for s in sessions if s["config"] == CONTROL}
    logs = [math.log(r) for r in per_session.values() if r is not None and r > 0]
    prompts = max((s["prompt"] + 1 for s in sessions if s["config"] == CONTROL), default=1)
    sd = statistics.stdev(logs) if len(logs) > 1 else None
    pooled = {k: c["summary"].get("auto_vs_both_edge_only") for k, c in cells.items()}
    out = {}
    for key, of, label, values in (
            ("control_every_cell", "auto_vs_edge_only_every_cell", "edge-only again >= {t:g}x edge-only on every cell",
             cell_ratios),
            ("control_session", "auto_session_vs_edge_only", "no edge-only-again session below {t:g}x edge-only",
             per_session),
            ("auto_vs_pooled_every_cell", "auto_vs_edge_only_every_cell",
             "auto >= {t:g}x edge-only's two runs pooled on every cell", pooled)):
        threshold = NEVER_LOSES_GOALS[of][1]
        v, where = _worst(values)
        below = sum(1 for x in values.values() if x is not None and x < threshold)
        out[key] = goal(label.format(t=threshold), v, threshold, f"worst {where}; {below} of {len(values)} below")
    return {"goals": out, "sessions": len(logs), "sd": sd,
            "cell_sd": sd / math.sqrt(prompts) if sd is not None else None,
            "geomean": math.exp(statistics.fmean(logs)) if logs else None, "groups": pooled_ratios(sessions, tps)}


def pooled_ratios(sessions: list[dict], tps: dict[tuple, float | None] | None = None) -> dict[str, dict]:
    """Per round trip, temperature and drafter cost, over every cell and prompt of it: auto's and the
    control's tokens/s against edge-only's on the same prompt and cell, as the geometric mean of the
    session ratios with its standard error (of the logs' mean, as a share): many more sessions than a
    cell's, so a loss of a few % can be told from the host's noise, which the control's own ratio
    shows in the same sessions. ``tps``: :func:`tps_by_session` of ``sessions``, if at hand."""
    tps = tps if tps is not None else tps_by_session(sessions)
    return pooled_summary(pooled_logs(sessions, tps, _pooled_group))


def _pooled_group(s: dict) -> str:
    cost = s.get("drafter_cost")
    return (f"{s.get('rtt_ms', 0):g} ms T{s['temperature']:g}"
            + (f" draft {cost:g}x" if isinstance(cost, (int, float)) else ""))


def pooled_logs(sessions: list[dict], tps: dict[tuple, float | None],
                group_of) -> dict[str, dict[str, list[float]]]:
    """{``group_of(session)``: {auto / the control: its sessions' log ratios to edge-only on the same cell
    and prompt}} (``tps``: :func:`tps_by_session` of ``sessions``)."""
    logs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in sessions:
        if s["config"] not in ("auto", CONTROL):
            continue
        r = vs_edge_only(tps, s)
        if r is not None and r > 0:
            logs[group_of(s)][s["config"]].append(math.log(r))
    return logs


def pooled_summary(logs: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per group (sorted) and configuration: the sessions, the geometric mean of their ratios and its
    standard error (of the logs' mean)."""
    return {g: {config: {"sessions": len(xs), "geomean": math.exp(statistics.fmean(xs)),
                         "se": statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None}
                for config, xs in by.items()} for g, by in sorted(logs.items())}


def never_loses_goals(cells: dict[str, dict], regret: list[dict]) -> dict[str, dict]:
    """Issue 46's goals over this run's cells (a run is one trace set at one or more drafter speeds)."""
    v, where = _worst({k: c["summary"]["auto_vs_edge_only"] for k, c in cells.items()})
    out = {"auto_vs_edge_only_every_cell": (v, f"worst {where}")}
    v, where = _worst({k: c["summary"].get("auto_vs_cell_best_fixed") for k, c in cells.items()})
    out["auto_vs_cell_best_fixed_every_cell"] = (v, f"worst {where}")
    v, where = _worst({f"{r['cell']} p{r['prompt']}": r["vs_edge_only"] for r in regret})
    out["auto_session_vs_edge_only"] = (v, f"worst {where}")
    return {key: goal(NEVER_LOSES_GOALS[key][0], value, NEVER_LOSES_GOALS[key][1], where)
            for key, (value, where) in out.items()}


def last_token_wall(s: dict) -> float | None:
    """When a session's last token arrived (:func:`token_events`, as its end wait is measured from), else
    when it ended (``extra.session_t1``): the stream's close comes after it, and an edge-only session
    whose last token came 1 ms before an outage closed 1 ms into it and was counted as having met it."""
    extra = s.get("extra", {})
    arrivals = [t for t, _ in token_events(extra.get("timeline") or [])]
    return max(arrivals) if arrivals else extra.get("session_t1")


def finish_line_splits(sessions: list[dict],
                       outages: dict[str, list[tuple[float, float]]]) -> dict[tuple[str, int], float]:
    """{(cell, prompt): seconds into its sessions where an outage began} for each prompt split at the finish
    line (module docstring): ``outages[trace]`` lists (start s, length s) into the recording (either
    direction's, FINISH_LINE_OUTAGE_S or longer); a session starts at its offset into it when the emulator
    applies it (``applied_wall``) and finishes with its last token (:func:`last_token_wall`). Prompts of a trace not in ``outages``,
    and sessions without those times, are never split."""
    ends: dict[tuple[str, int], list[float]] = defaultdict(list)
    offset: dict[tuple[str, int], tuple[str, float]] = {}
    for s in sessions:
        last, applied = last_token_wall(s), s.get("applied_wall")
        if s.get("trace") in outages and isinstance(last, (int, float)) and isinstance(applied, (int, float)):
            key = (s["cell"], s["prompt"])
            ends[key].append(last - applied)
            offset[key] = (s["trace"], s["offset_s"])
    out = {}
    for key, e in ends.items():
        trace, start = offset[key]
        began = [a - start for a, _ in outages[trace] if min(e) < a - start < max(e)]
        if began:
            out[key] = min(began)
    return out


def finish_line(cells: dict[str, dict], sessions: list[dict], outages: dict[str, list[tuple[float, float]]],
                best_fixed: str, default: str) -> dict:
    """The cells over their prompts not split at the finish line (:func:`finish_line_splits`): per cell the
    split prompts (prompt, seconds into the session where the outage began) and the summary of the
    others (None if none is left), and issue 46's goals over those."""
    splits = finish_line_splits(sessions, outages)
    kept = [s for s in sessions if (s["cell"], s["prompt"]) not in splits]
    out_cells, judged = {}, {}
    for name in cells:
        mine = [s for s in kept if s["cell"] == name]
        summary = cell_summary(config_stats(mine), best_fixed, default) if mine else None
        out_cells[name] = {"split": sorted([p, round(t, 2)] for (c, p), t in splits.items() if c == name),
                           "summary": summary}
        if summary is not None:
            judged[name] = {"summary": summary}
    return {"outage_s": FINISH_LINE_OUTAGE_S, "cells": out_cells, "split_prompts": len(splits),
            "goals": never_loses_goals(judged, session_regret(judged, kept))}


def per_trace(cells: dict[str, dict], sessions: list[dict], best_fixed: str) -> dict[str, dict]:
    """Per (trace, temperature): the ratios' geometric means over round trips and the pooled gaps."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for c in cells.values():
        groups[f"{c['trace']}@T{c['temperature']:g}"].append(c)
    pooled: dict[str, list[dict]] = defaultdict(list)
    for s in sessions:
        pooled[f"{s['trace']}@T{s['temperature']:g}"].append(s)
    out = {}
    for key, cs in groups.items():
        stats = config_stats(pooled[key])
        out[key] = {"trace": cs[0]["trace"], "temperature": cs[0]["temperature"],
                    "auto_vs_best_fixed": geomean([c["summary"]["auto_vs_best_fixed"] for c in cs]),
                    "auto_vs_edge_only": geomean([c["summary"]["auto_vs_edge_only"] for c in cs]),
                    "auto_vs_default": geomean([c["summary"]["auto_vs_default"] for c in cs]),
                    "gap_p95": {n: v["gap_p95"] for n, v in stats.items()},
                    "auto_gap_p95_vs_best": ratio(stats.get("auto", {}).get("gap_p95"),
                                                  stats.get(best_fixed, {}).get("gap_p95"))}
    return out


def _worst(values: dict[str, float | None], highest: bool = False) -> tuple[float | None, str]:
    vals = {k: v for k, v in values.items() if v is not None}
    if not vals:
        return None, ""
    k = (max if highest else min)(vals, key=vals.get)
    return vals[k], k


def goals(cells: dict[str, dict], traces: dict[str, dict]) -> dict[str, dict]:
    """The issue's goals, each measured over every trace at both temperatures of this run."""
    out = {}
    value = geomean([c["summary"]["auto_vs_best_fixed"] for c in cells.values()])
    by_t = {f"T={t:g}": geomean([c["summary"]["auto_vs_best_fixed"] for c in cells.values() if c["temperature"] == t])
            for t in sorted({c["temperature"] for c in cells.values()})}
    out["auto_vs_best_geomean"] = (value, f"{len(cells)} cells; " + ", ".join(
        f"{k}: {v:.2f}" for k, v in by_t.items() if v is not None))
    v, where = _worst({k: t["auto_vs_best_fixed"] for k, t in traces.items()})
    out["auto_vs_best_every_trace"] = (v, f"worst {where}")
    v, where = _worst({k: t["auto_vs_edge_only"] for k, t in traces.items()})
    out["auto_vs_edge_only"] = (v, f"worst {where}")
    v, where = _worst({k: t["auto_gap_p95_vs_best"] for k, t in traces.items()}, highest=True)
    edge = traces.get(where, {}).get("gap_p95", {})
    out["auto_p95_gap_vs_best"] = (v, f"worst {where}" + (
        f" (p95 gap: auto {edge.get('auto', 0) * 1e3:.0f} ms, edge-only {edge.get('none', 0) * 1e3:.0f} ms)"
        if edge.get("auto") is not None and edge.get("none") is not None else ""))
    return {key: goal(GOALS[key][0], value, GOALS[key][1], where, at_most=key == "auto_p95_gap_vs_best")
            for key, (value, where) in out.items()}
