"""Issue 46's matrix: the goals judged over several bench-traces runs at once, against the host's noise.

Issue 46 asks mode auto for goals on every cell of a matrix (the held-out traces at each round trip,
temperature and drafter speed, and the tuning set) that no single run covers: each run is one trace set
at one or more drafter speeds, and the matrix is the union of the runs made on one controller. Its
goal of auto >= 0.97x edge-only on every cell sits within a cell's host noise where auto rightly runs
edge-only (a cell of 3-6 prompts moves 3-4 % with no difference at all: the control, edge-only run
twice, misses the same line in some cells). So each cell below the line is also told as a shortfall
the noise explains or one it does not: ``z`` is the cell's log ratio over 0.97's, in standard errors
of a cell's ratio (the run's per-session spread of the control's log ratios, or of the A/A pairs'
where the run had no control, over the root of the cell's prompts); below ``SIGNIFICANT_Z`` the loss
is real at ~2 % one-sided. A diagnostic beside the goals, which stay judged on the ratios themselves.
Likewise each cell's prompts split at the finish line (an outage of the recording began between their
sessions' ends: analyze's module docstring), and the goals again without them.

Pure: runs come in as the dicts bench-traces wrote (its ``bench_traces.json.gz``).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import PurePath

from specdec.bench.traces import analyze, plan
from specdec.bench.harness.analyze import fmt

# A cell's shortfall below the 0.97 line larger than this many standard errors is a loss the host's noise
# does not explain (one-sided, ~2 % by chance in a cell where auto is at the line).
SIGNIFICANT_Z = -2.0


def analyzed_cells(data: dict) -> dict[str, dict]:
    """The run's cells with their per-configuration stats and summary, computed from its sessions."""
    out = {}
    for name, c in data["cells"].items():
        stats = analyze.config_stats([s for s in data["sessions"] if s["cell"] == name])
        out[name] = {**c, "stats": stats, "summary": analyze.cell_summary(stats, data["best_fixed"], data["default"])}
    return out


def run_noise(data: dict, tps: dict[tuple, float | None]) -> tuple[float | None, str]:
    """(per-session sd of log ratios to edge-only with no difference, its source): the control's where
    the run had one, else the A/A pairs' (auto sessions that ran edge-only rounds only); ``tps``:
    :func:`analyze.tps_by_session` of the run's sessions."""
    logs = [math.log(r) for s in data["sessions"] if s["config"] == analyze.CONTROL
            if (r := analyze.vs_edge_only(tps, s)) is not None and r > 0]
    if len(logs) > 1:
        return statistics.stdev(logs), "control"
    aa = analyze.host_noise(data["sessions"], data["settings"].get("prompts", 1))
    return aa["sd"], "A/A"


def cell_rows(label: str, data: dict, outages: dict[str, list[tuple[float, float]]] | None = None,
              tps: dict[tuple, float | None] | None = None) -> list[dict]:
    """One row per cell of a run: auto's and the control's ratios to edge-only, auto's to the cell's best
    fixed, the worst auto and control sessions, how far auto is from the 0.97 line in standard errors,
    and with ``outages`` (the run's recordings' outages, :func:`analyze.finish_line_splits`) the cell's
    prompts split at the finish line and auto's ratios over the others (``kept``); ``tps``:
    :func:`analyze.tps_by_session` of its sessions, if at hand."""
    cells = analyzed_cells(data)
    regret = analyze.session_regret(cells, data["sessions"])
    splits = analyze.finish_line_splits(data["sessions"], outages or {})
    kept = [s for s in data["sessions"] if (s["cell"], s["prompt"]) not in splits]
    kept_cells = analyzed_cells({**data, "sessions": kept})
    kept_regret = analyze.session_regret(kept_cells, kept)
    tps = tps if tps is not None else analyze.tps_by_session(data["sessions"])
    sd, source = run_noise(data, tps)
    threshold = analyze.NEVER_LOSES_GOALS["auto_vs_edge_only_every_cell"][1]
    rows = []
    for name, c in cells.items():
        s = c["summary"]
        prompts = sum(1 for x in data["sessions"] if x["cell"] == name and x["config"] == "auto")
        auto = s["auto_vs_edge_only"]
        se = sd / math.sqrt(prompts) if sd is not None and prompts else None
        z = (math.log(auto / threshold) / se) if auto and se else None
        controls = [r for x in data["sessions"] if x["cell"] == name and x["config"] == analyze.CONTROL
                    if (r := analyze.vs_edge_only(tps, x)) is not None]
        rows.append({"run": label, "cell": name, "rtt_ms": c.get("rtt_ms"), "temperature": c.get("temperature"),
                     "cost": plan.cost_label(c.get("drafter_cost")), "prompts": prompts, "auto_vs_edge_only": auto,
                     "control_vs_edge_only": s.get("control_vs_edge_only"),
                     "auto_vs_cell_best_fixed": s.get("auto_vs_cell_best_fixed"),
                     "worst_session": min((r["vs_edge_only"] for r in regret
                                           if r["cell"] == name and r["vs_edge_only"] is not None), default=None),
                     "worst_control_session": min(controls, default=None),
                     "se": se, "noise": source, "z": z, "verdict": verdict(auto, z, threshold),
                     "split": sorted(p for c_, p in splits if c_ == name),
                     **_kept(kept_cells[name]["summary"], kept_regret, name)})
    return rows


def _kept(summary: dict, regret: list[dict], name: str) -> dict:
    """Auto's ratios in cell ``name`` over its prompts not split at the finish line (None: none left)."""
    return {"auto_vs_edge_only_kept": summary.get("auto_vs_edge_only"),
            "auto_vs_cell_best_fixed_kept": summary.get("auto_vs_cell_best_fixed"),
            "worst_session_kept": min((r["vs_edge_only"] for r in regret
                                       if r["cell"] == name and r["vs_edge_only"] is not None), default=None)}


def verdict(ratio: float | None, z: float | None, threshold: float) -> str:
    """"met", "noise" (below the line by less than the noise explains) or "loss" (by more), "?" unmeasured."""
    if ratio is None:
        return "?"
    if ratio >= threshold:
        return "met"
    return "loss" if z is not None and z < SIGNIFICANT_Z else "noise"


def group_logs(data: dict, tps: dict[tuple, float | None]) -> dict[str, dict[str, list[float]]]:
    """:func:`analyze.pooled_logs` per trace set, round trip, temperature and drafter cost; the trace set is
    the run's folder's name (the held-out and tuning sets apart)."""
    folder = PurePath(str(data.get("traces_folder", ""))).name

    def group_of(s: dict) -> str:
        return f"{folder} {s.get('rtt_ms', 0):g} ms T{s['temperature']:g} {plan.cost_label(s.get('drafter_cost'))}".strip()
    return analyze.pooled_logs(data["sessions"], tps, group_of)


def matrix(runs: list[tuple[str, dict]], outages: list[dict] | None = None) -> dict:
    """Issue 46's goals over every cell of ``runs`` ((label, run) pairs): the rows, the goals' worst values
    and how many cells or sessions miss each (auto's and the control's), the same over the prompts not
    split at the finish line (``outages``: each run's recordings' outages, where known), and the
    session ratios pooled per trace set, round trip, temperature and drafter cost over the runs (geometric mean +-
    standard error)."""
    outages = outages or [{} for _ in runs]
    tps = [analyze.tps_by_session(data["sessions"]) for _, data in runs]
    rows = [row for (label, data), out, t in zip(runs, outages, tps) for row in cell_rows(label, data, out, t)]
    logs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (_, data), t in zip(runs, tps):
        for group, by in group_logs(data, t).items():
            for config, xs in by.items():
                logs[group][config].extend(xs)
    pooled = analyze.pooled_summary({g: dict(sorted(by.items())) for g, by in logs.items()})
    return {"rows": rows, "goals": matrix_goals(rows), "pooled": pooled,
            "split_prompts": sum(len(r["split"]) for r in rows),
            "goals_kept": matrix_goals(rows, kept=True)}


def matrix_goals(rows: list[dict], kept: bool = False) -> dict[str, dict]:
    """Each issue-46 goal over the matrix: its line, auto's worst value and where, the cells (or cells
    with a session) below the line, and the control's, where the runs had one; ``kept``: auto's values
    over the prompts not split at the finish line."""
    out = {}
    tail = "_kept" if kept else ""
    for key, (text, line) in analyze.NEVER_LOSES_GOALS.items():
        mine, control = {"auto_vs_edge_only_every_cell": ("auto_vs_edge_only" + tail, "control_vs_edge_only"),
                         "auto_vs_cell_best_fixed_every_cell": ("auto_vs_cell_best_fixed" + tail, None),
                         "auto_session_vs_edge_only": ("worst_session" + tail, "worst_control_session")}[key]
        values = [(r[mine], f"{r['run']}: {r['cell']}") for r in rows if r[mine] is not None]
        worst = min(values, default=(None, ""))
        below = [where for v, where in values if v < line]
        out[key] = {"goal": text, "threshold": line, "value": worst[0], "where": worst[1], "cells": len(values),
                    "below": below, "pass": not below if values else None}
        if control and not kept:
            theirs = [r[control] for r in rows if r[control] is not None]
            out[key]["control_cells"] = len(theirs)
            out[key]["control_below"] = sum(1 for v in theirs if v < line)
    if not kept:
        out["auto_vs_edge_only_every_cell"]["losses"] = [f"{r['run']}: {r['cell']}" for r in rows
                                                         if r["verdict"] == "loss"]
    return out


def print_matrix(m: dict) -> None:
    print("issue 46's matrix: per cell, auto / edge-only (z: its distance from the 0.97 line in standard errors "
          "of the host's noise), the control / edge-only, auto / the cell's best fixed, the worst auto (control) "
          "session / edge-only")
    run = None
    for r in m["rows"]:
        if r["run"] != run:
            run = r["run"]
            print(f"\n{run}")
        control = (f"control {fmt(r['control_vs_edge_only'])}" if r["control_vs_edge_only"] is not None else "")
        worst_control = (f" ({fmt(r['worst_control_session'])})" if r["worst_control_session"] is not None else "")
        print(f"  {r['cell']:<44} auto {fmt(r['auto_vs_edge_only'])} (z {fmt(r['z'], '+.1f')}, {r['verdict']:<5}) "
              f"{control:<13} best fixed {fmt(r['auto_vs_cell_best_fixed'])}  worst session "
              f"{fmt(r['worst_session'])}{worst_control}  [{r['prompts']} prompts, se {fmt(r['se'], '.3f')} {r['noise']}]")
        if r["split"]:
            print(f"    split at the finish line: {', '.join(f'p{p}' for p in r['split'])}; the others: auto / edge-only "
                  f"{fmt(r['auto_vs_edge_only_kept'])}, / the cell's best fixed {fmt(r['auto_vs_cell_best_fixed_kept'])}, "
                  f"worst session {fmt(r['worst_session_kept'])}")
    _print_goals("the goals over the matrix", m["goals"])
    if m["split_prompts"]:
        _print_goals(f"the same without the {m['split_prompts']} prompt(s) split at the finish line (a diagnostic: "
                     "the goals above are the verdict)", m["goals_kept"])
    print("\npooled per trace set, round trip, temperature and drafter cost over the runs (geometric mean of the session "
          "ratios to edge-only +- its standard error)")
    for group, by in m["pooled"].items():
        print(f"  {group:<30} " + "   ".join(f"{name} {fmt(v['geomean'], '.3f')} +- {fmt(v['se'], '.3f')} "
                                            f"(n = {v['sessions']})" for name, v in by.items()))


def _print_goals(title: str, goals: dict[str, dict]) -> None:
    print(f"\n{title}")
    for g in goals.values():
        verdict_ = {True: "PASS", False: "MISS", None: "----"}[g["pass"]]
        control = (f"; the control: {g['control_below']} of {g['control_cells']} below"
                   if g.get("control_cells") else "")
        print(f"  [{verdict_}] {g['goal']}: worst {fmt(g['value'], '.3f')} ({g['where']}); "
              f"{len(g['below'])} of {g['cells']} cells below{control}")
        if "losses" in g:
            print(f"         below by more than the host's noise (z < {SIGNIFICANT_Z:g}): "
                  + (", ".join(g["losses"]) if g["losses"] else "none"))
