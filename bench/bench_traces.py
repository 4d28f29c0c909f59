"""bench-traces: the pair over recorded cellular links (Mahimahi traces), edge-only vs the fixed default
vs the links grid's best fixed configuration vs ``mode auto`` (issue 35, item 2).

    make bench-traces                        # every trace of ../shared/traces, RTT 40 and 80 ms, T = 0 and 1
    make bench-traces ARGS=--quick           # a few minutes: RTT 80 ms, 2 prompts x 48 tokens per cell
    .venv/bin/python -m specdec.bench.bench_traces [--quick] [--traces DIR] [--only NAME,...] [--rtts 40,80]
        [--temperatures 0,1] [--prompts N] [--max-new-tokens N] [--queue 150kb|100pkt] [--check-seconds S]
        [--ignore-eos] [--control] [--replot DIR] [--matrix DIR [DIR ...]]

Needs root (network namespaces). One edge-server and one device driver for the whole run, in two
namespaces (the harness rig's "emulated" link, bench/harness/rig.py) with no tbf: the userspace
emulator (testbed/linkemu.py) in the device namespace replays each trace pair (``NAME.up`` device to
edge, ``NAME.down`` back) with the base round trip on top. Before each session the emulator is
restarted at that session's offset into the trace, so every configuration of a prompt meets the same
stretch of the recording; the configurations run interleaved on the same prompts and seeds
(bench/traces/plan.py). First, unless ``--check-seconds 0``, a saturating stream through the
emulator on loopback checks each uplink trace's capacity per second (testbed/tracecheck.py).

Writes results/bench_traces/<timestamp>/ (and results/bench_traces/latest): bench_traces.json.gz
(every session with its round timeline, per cell and per trace numbers, the emulator check, the
goals), summary.txt (what it prints), trace_<NAME>.png (tokens/s under the capacity, auto's choices),
logs/. Ends with the issue's goals as [PASS] / [MISS] lines.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import io
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.analyze import fmt, print_goals  # noqa: E402
from specdec.bench.harness.rig import Rig, shaping_available  # noqa: E402
from specdec.bench.traces import analyze, matrix, plan  # noqa: E402
from specdec.testbed.traces import load_trace  # noqa: E402
from specdec.testbed.units import parse_queue  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_traces"
WARMUP_TOKENS = 8
CALIBRATION_TOKENS = 48   # per calibration session: enough rounds that the per-token costs settle
# Between sessions (wait_link_idle): the longest wait for the link to drain (a link that never does, a
# stalled run, holds the bench no longer), and a margin past the last byte's release for the emulator's
# own scheduling.
MAX_IDLE_WAIT_S = 30.0
IDLE_SETTLE_S = 0.05
MAX_TARGET_SLOWDOWN = 10.0  # beyond it a 96-token edge-only session takes minutes here


class Run:
    def __init__(self, s: plan.Settings, recs: list[plan.Recording], configs: list[str], extra: dict, out: Path):
        self.s, self.recs, self.configs, self.extra, self.out = s, recs, configs, extra, out
        self.prompts = harness_plan.sample_texts(s.prompts)
        self.sessions: list[dict] = []
        self.errors: list[dict] = []
        self.warmup: dict[str, dict] = {}   # config -> its warm-up session's record
        self.cells: dict[str, dict] = {}
        self.rows = 0  # balanced turn orders used so far (harness.plan.balanced)

    def warm_up(self, rig: Rig) -> None:
        """One short session per config, untimed. Mode auto's memory starts from what its warm-up's rounds
        measured, so those are kept (``warmup`` in the run's data: each config's record)."""
        rec = self.recs[0]
        rig.set_emulator(rec.emulator(rec.offsets_s[0], self.s.rtts_ms[0], self.s.queue))
        for name in self.configs:
            job = plan.Session("warmup", rec.name, 0, self.s.temperatures[0], name, 0, 0.0,
                               plan.links_plan.config_device(name, self.extra.get(name)))

            def on_line(line: dict, name: str = name) -> None:
                if "record" in line:
                    self.warmup[name] = line["record"]
                elif "error" in line:
                    self.errors.append(line)
            rig.run([job.to_driver(self.prompts, WARMUP_TOKENS)], on_line)
        auto = self.warmup.get("auto")
        if auto is not None:
            print("auto's warm-up: " + ", ".join(f"{r['mode']} {r['generated']} tok" for r in auto["rounds"]), flush=True)

    def one(self, rig: Rig, rec: plan.Recording, sess: plan.Session) -> None:
        wait_link_idle(rig)
        reply = rig.set_emulator(rec.emulator(sess.offset_s, sess.rtt_ms, self.s.queue))

        def on_line(line: dict) -> None:
            if "record" in line:
                entry = {**vars(sess), "up": rec.up, "down": rec.down, "applied_wall": reply["applied_wall"],
                         "seed": line["seed"], "record": line["record"], "extra": line["extra"]}
                self.sessions.append(entry)
                st = line["record"]["stats"]
                print(f"  {sess.cell:<32} {sess.config:<11} p{sess.prompt} @{sess.offset_s:6.1f} s "
                      f"{st['generated_tokens']:>4} tok {st['wall_seconds']:6.2f} s "
                      f"{st['tokens_per_second']:6.1f} tok/s", flush=True)
            elif "error" in line:
                self.errors.append({**vars(sess), **line})
                print(f"  ERROR {sess.id}: {line['error']}", flush=True)
        rig.run([sess.to_driver(self.prompts, self.s.max_new_tokens, self.s.ignore_eos)], on_line)

    def calibrate(self, rig: Rig) -> dict:
        """The target's seconds per token (an edge-only session's edge forward time per token) and the
        drafter's per draft token (a TSLT session's drafting time per drafted token), as they run here,
        on a stretch of the first trace: what the drafter-cost axis scales."""
        rec = self.recs[0]
        got: dict[str, dict] = {}
        for name in ("none", plan.DEFAULT):
            rig.set_emulator(rec.emulator(rec.offsets_s[0], self.s.rtts_ms[0], self.s.queue))
            job = plan.Session("calibrate", rec.name, 0, 0.0, name, 0, 0.0, plan.links_plan.config_device(name))
            rig.run([job.to_driver(self.prompts, CALIBRATION_TOKENS)],
                    lambda line: got.__setitem__(name, line["record"]["stats"]) if "record" in line else None)
        edge, drafted = got["none"], got[plan.DEFAULT]
        target = edge["time"]["verify"] / max(1, edge["generated_tokens"])
        drafter = drafted["time"]["draft"] / max(1, drafted["draft_tokens"])
        return {"target_token_s": target, "drafter_token_s": drafter, "drafter_cost": drafter / target,
                "delays_s": plan.drafter_delays(self.s.drafter_costs, target, drafter)}

    def cells_of(self, rec: plan.Recording, cost: float | None, delay_s: float):
        for rtt in self.s.rtts_ms:
            for temp in self.s.temperatures:
                sessions = plan.cell_sessions(rec, rtt, temp, self.configs, self.extra, cost, delay_s, self.rows)
                self.rows += len(rec.offsets_s)  # the balanced orders go on where the last cell's stopped
                yield rtt, temp, sessions

    def run(self, rig: Rig, best_fixed: str, delays: dict[float, float]) -> None:
        # the drafter's speed outermost: the device changes speed once per group, as a device would not
        # between requests, and mode auto's memory of the last group is what it starts the next from
        for cost, delay_s in (delays.items() if delays else [(None, 0.0)]):
            for rec in self.recs:
                self.run_recording(rig, rec, best_fixed, cost, delay_s)

    def run_recording(self, rig: Rig, rec: plan.Recording, best_fixed: str, cost: float | None,
                      delay_s: float) -> None:
        for rtt, temp, sessions in self.cells_of(rec, cost, delay_s):
            name = plan.cell_name(rec.name, rtt, temp, cost)
            print(f"[{name}] {len(sessions)} sessions, offsets {', '.join(f'{o:g}' for o in rec.offsets_s)} s",
                  flush=True)
            for sess in sessions:
                self.one(rig, rec, sess)
            got = [x for x in self.sessions if x["cell"] == name]
            stats = analyze.config_stats(got)
            self.cells[name] = {"name": name, "trace": rec.name, "rtt_ms": rtt, "temperature": temp,
                                "drafter_cost": cost, "draft_delay_s": delay_s,
                                "stats": stats, "summary": analyze.cell_summary(stats, best_fixed, plan.DEFAULT)}


def check_traces(recs: list[plan.Recording], seconds: float) -> dict:
    """The emulator against each uplink trace: a saturating stream per second, from its first offset."""
    from specdec.testbed.tracecheck import measure
    out = {}
    for rec in recs:
        r = asyncio.run(measure(rec.up, seconds, rec.offsets_s[0], 1.0))
        out[rec.name] = r
        print(f"  {rec.name}.up from {rec.offsets_s[0]:g} s, {seconds:g} s: delivered / capacity "
              f"{r['ratio_total']:.3f}, mean |error| per second {r['mean_abs_error_share']:.3f} of it", flush=True)
    return out


# ----------------------------------------------------------------------------- reporting
def print_tables(data: dict) -> None:
    configs, best = data["configs"], data["best_fixed"]
    print(f"\nper cell: tokens/s | TTFT s (mean) | gap p50/p95/max ms | bytes/token up/down | device CPU ms/token "
          f"| end wait p50/max ms (after the last token) (best fixed of the links grid: {best})")
    for name, c in data["cells"].items():
        print(f"{name}")
        for cfg in configs:
            v = c["stats"].get(cfg)
            if not v:
                continue
            ms = lambda x: fmt(x * 1e3 if x is not None else None, ".0f")  # noqa: E731
            print(f"  {cfg:<12}{fmt(v['tps'], '.1f'):>7} tok/s  TTFT {fmt(v['ttft_mean'], '.2f'):>5}  "
                  f"gap {ms(v['gap_p50']):>4}/{ms(v['gap_p95']):>5}/{ms(v['gap_max']):>5} ms  "
                  f"{fmt(v['up_bytes_per_token'], '.0f'):>6}/{fmt(v['down_bytes_per_token'], '.0f'):>4} B  "
                  f"{ms(v.get('device_cpu_per_token')):>4}  end {ms(v.get('end_wait_p50')):>4}/{ms(v.get('end_wait_max')):>5}")
        s = c["summary"]
        print(f"  auto / best fixed {fmt(s['auto_vs_best_fixed'])}, / edge-only {fmt(s['auto_vs_edge_only'])}, "
              f"/ default {fmt(s['auto_vs_default'])}"
              + (f"; control: edge-only again / edge-only {fmt(s['control_vs_edge_only'])}, "
                 f"auto / both edge-only runs {fmt(s.get('auto_vs_both_edge_only'))}"
                 if s.get("control_vs_edge_only") is not None else ""))
        per_prompt = sorted((r["prompt"], r["vs_best_fixed"]) for r in data.get("regret", []) if r["cell"] == name)
        if per_prompt:
            print("  auto / cell's best fixed per prompt: " + ", ".join(f"p{p} {fmt(v)}" for p, v in per_prompt))
        line = finish_line_note(data.get("finish_line", {}).get("cells", {}).get(name))
        if line:
            print(f"  {line}")
    cal = data.get("calibration")
    if cal:
        slowed = data["settings"].get("target_slowdown", 1.0)
        print(f"\ndrafter as it runs here: {cal['drafter_token_s'] * 1e3:.1f} ms per draft token, target "
              f"{cal['target_token_s'] * 1e3:.1f} ms per token"
              + (f" (its forwards slowed {slowed:g}x)" if slowed != 1 else "")
              + f": drafter cost {cal['drafter_cost']:.2f}x; slowed to "
              + ", ".join(f"{plan.cost_label(c)} (+{d * 1e3:.0f} ms per forward)" for c, d in cal["delays_s"].items()))
    r = data.get("regret_summary")
    if r:
        print("\nper auto session (same cell and prompt): p5 / p50 / p95 (min) over "
              f"{r['vs_better']['sessions']} sessions")
        for key, label in (("vs_better", "auto / better of edge-only and the cell's best fixed"),
                           ("vs_edge_only", "auto / edge-only"), ("vs_best_fixed", "auto / the cell's best fixed")):
            v = r[key]
            print(f"  {label:<56} {fmt(v['p5'])} / {fmt(v['p50'])} / {fmt(v['p95'])} ({fmt(v['min'])})")
    n = data.get("host_noise")
    if n and n["sd"] is not None:
        print(f"\nthe host's noise (A/A): {n['pairs']} auto sessions that ran edge-only rounds only, against "
              f"edge-only on the same prompt and cell: geometric mean {fmt(n['geomean'], '.3f')}, per-session sd "
              f"{fmt(n['sd'], '.3f')} (log); a cell of {data['settings']['prompts']} prompts moves "
              f"~{fmt(n['cell_sd'], '.3f')} (1 sd) with no difference between the configurations")
    sp = (n or {}).get("split")
    if sp and sp["pairs"]:
        print(f"  where the A/A pairs' time went ({sp['pairs']} pairs, auto / edge-only): time to first token "
              f"{fmt(sp['ttft_ratio'], '.3f')}, median gap between streamed tokens {fmt(sp['gap_ratio'], '.3f')}; "
              f"auto's round boundaries ({fmt(sp['boundaries_mean'], '.1f')} a session) cost "
              f"{fmt(100 * sp['boundary_share'], '.1f')} % of its wall beyond a streamed gap")
    h = data.get("host_slowdowns")
    if h and h["slowed"]:
        where = ", ".join(f"{x['t_s']:.0f} s {x['cell']} p{x['prompt']} {x['config']} {x['median_gap_ms']:.0f} ms"
                          for x in h["slowed"])
        print(f"host slowdowns: {len(h['slowed'])} session(s) streamed at {analyze.SLOW_STREAM}x the run's median gap "
              f"({h['median_gap_ms']:.1f} ms) or slower (the host, whichever configuration ran): {where}")
    print("\nper trace and temperature (geometric mean over round trips; p95 gap over both round trips' sessions)")
    for key, t in data["traces"].items():
        gaps = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t["gap_p95"].items() if v is not None)
        print(f"  {key:<28} auto/best {fmt(t['auto_vs_best_fixed'])}  auto/edge-only {fmt(t['auto_vs_edge_only'])}  "
              f"auto/default {fmt(t['auto_vs_default'])}  p95 gap ms: {gaps}")


def finish_line_note(view: dict | None) -> str | None:
    """The line under a cell whose prompts an outage split at the finish line (analyze.finish_line)."""
    if not view or not view["split"]:
        return None
    where = ", ".join(f"p{p} (outage {t:.1f} s in)" for p, t in view["split"])
    s = view["summary"]
    rest = ("no prompt left" if s is None else
            f"the others: auto / cell's best fixed {fmt(s.get('auto_vs_cell_best_fixed'))}, "
            f"/ edge-only {fmt(s['auto_vs_edge_only'])}")
    return f"split at the finish line: {where}; {rest}"


def wait_link_idle(rig: Rig) -> float:
    """Wait until the bytes the last session left inside the emulated link (its Close and the edge's
    reply) have left it; the seconds waited. Each session then starts on an empty link: bytes of one
    connection leave in order, so a Close that met an outage of the last session's stretch of trace
    held the next session's Hello for the rest of that outage (2 s), in whichever configuration ran
    next. Capped, so that a link that never drains cannot stall the run."""
    waited = min(float(rig.set_emulator({}).get("idle_in_s", 0.0)), MAX_IDLE_WAIT_S)
    if waited > 0:
        time.sleep(waited + IDLE_SETTLE_S)
    return waited


def trace_outages(recordings: list[dict], min_s: float = analyze.FINISH_LINE_OUTAGE_S) -> dict[str, list]:
    """{recording: (start s, length s) of each outage of ``min_s`` or longer, either direction}; a recording
    whose trace files cannot be read (a run's JSON read back elsewhere) is left out."""
    out = {}
    for r in recordings:
        try:
            out[r["name"]] = sorted(o for path in (r["up"], r["down"]) for o in load_trace(path).outages(min_s * 1e3))
        except ValueError:
            continue
    return out


def analyze_all(data: dict) -> None:
    best = data["best_fixed"]
    for c in data["cells"].values():
        c["stats"] = analyze.config_stats([s for s in data["sessions"] if s["cell"] == c["name"]])
        c["summary"] = analyze.cell_summary(c["stats"], best, plan.DEFAULT)
    data["traces"] = analyze.per_trace(data["cells"], data["sessions"], best)
    data["goals"] = analyze.goals(data["cells"], data["traces"])
    data["regret"] = analyze.session_regret(data["cells"], data["sessions"])
    data["regret_summary"] = analyze.regret_summary(data["regret"])
    data["never_loses_goals"] = analyze.never_loses_goals(data["cells"], data["regret"])
    data["host_noise"] = analyze.host_noise(data["sessions"], data["settings"]["prompts"])
    data["control"] = analyze.control_goals(data["cells"], data["sessions"])
    data["host_slowdowns"] = analyze.host_slowdowns(data["sessions"])
    data["finish_line"] = analyze.finish_line(data["cells"], data["sessions"], trace_outages(data["recordings"]),
                                              best, plan.DEFAULT)


def make_plots(data: dict, out: Path) -> list[str]:
    from specdec.bench.traces import plots
    note = (f"bench-traces {data['started']}, {data['settings']['prompts']} prompt(s) x "
            f"{data['settings']['max_new_tokens']} tokens per config and cell; rev {str(data['git']['revision'])[:10]}")
    paths = []
    for trace in sorted({c["trace"] for c in data["cells"].values()}):
        cells = [c for c in data["cells"].values() if c["trace"] == trace]
        p = plots.trace_figure(trace, cells, data["sessions"], out / f"trace_{trace}.png", note)
        if p:
            paths.append(p.name)
    p = plots.regret_figure(data.get("regret", []), out / "regret.png", note)
    if p:
        paths.append(p.name)
    return paths


def write(data: dict, out: Path) -> None:
    with gzip.open(out / "bench_traces.json.gz", "wt") as f:
        json.dump(data, f, default=str)


def finish(data: dict, out: Path) -> None:
    analyze_all(data)
    data["plots"] = make_plots(data, out)
    write(data, out)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_tables(data)
        print_goals("issue 35 goals", data["goals"])
        print_goals("issue 46 goals (auto never loses)", data["never_loses_goals"])
        control = data.get("control")
        if control:
            print_goals(f"the control: issue 46's goals against edge-only with edge-only run again in auto's place "
                        f"(the host alone; {control['sessions']} sessions, geometric mean {fmt(control['geomean'], '.3f')}, "
                        f"per-session sd {fmt(control['sd'], '.3f')} (log), a cell's ratio "
                        f"~{fmt(control['cell_sd'], '.3f')} (1 sd))", control["goals"])
            print("  pooled over each round trip, temperature and drafter cost (geometric mean of the session ratios "
                  "to edge-only on the same prompt, +- its standard error):")
            for group, by in control.get("groups", {}).items():
                print(f"    {group:<20} " + "   ".join(
                    f"{name} {fmt(v['geomean'], '.3f')} +- {fmt(v['se'], '.3f')} (n = {v['sessions']})"
                    for name, v in sorted(by.items())))
        fl = data["finish_line"]
        if fl["split_prompts"]:
            print_goals(f"the same without the {fl['split_prompts']} prompt(s) an outage of {fl['outage_s']:g} s or more "
                        "split at the finish line (a diagnostic: the goals above are the verdict)", fl["goals"])
    text = buf.getvalue()
    print(text)
    (out / "summary.txt").write_text(text)
    print(f"results: {out}")


def print_matrix_of(dirs: list[Path]) -> int:
    """Print issue 46's matrix over the runs in ``dirs`` (each holding a bench_traces.json.gz)."""
    runs = []
    for d in dirs:
        path = d / "bench_traces.json.gz"
        if not path.is_file():
            print(f"bench-traces: no bench_traces.json.gz in {d}", file=sys.stderr)
            return 2
        data = json.loads(gzip.open(path).read())
        runs.append((f"{d.parent.name}/{d.name} ({str(data['git']['revision'])[:7]}, {data['started']})", data))
    outages = [trace_outages([_found(r) for r in data["recordings"]]) for _, data in runs]
    matrix.print_matrix(matrix.matrix(runs, outages))
    return 0


def _found(recording: dict) -> dict:
    """A run's recording with its trace files where they are here: as the run named them, else the
    same names in the folders the bench reads (a run made in another checkout); left as it was (and so
    without outages) where neither is."""
    if Path(recording["up"]).is_file() and Path(recording["down"]).is_file():
        return recording
    for folder in (*plan.TRACE_SETS, *plan.DEFAULT_TRACES):
        up, down = folder / Path(recording["up"]).name, folder / Path(recording["down"]).name
        if up.is_file() and down.is_file():
            return {**recording, "up": str(up), "down": str(down)}
    return recording


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--traces", type=Path, default=None, help="folder of Mahimahi NAME.up / NAME.down pairs "
                   "(default: ../shared/traces)")
    p.add_argument("--only", default="", help="comma-separated trace names (substrings)")
    p.add_argument("--rtts", default="", help="base round trips in ms, e.g. 40,80")
    p.add_argument("--temperatures", default="", help="e.g. 0,1")
    p.add_argument("--prompts", type=int, default=None, help="prompts (and offsets) per cell")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--queue", default="", help="drop-tail queue limit of each direction, e.g. 150kb or 100pkt")
    p.add_argument("--check-seconds", type=float, default=None, help="emulator check per trace (0: skip)")
    p.add_argument("--drafter-costs", default="", help="slow the drafter to these multiples of the target's "
                   "time per token, e.g. natural,1.0,1.5 (natural: as it runs; the default)")
    p.add_argument("--target-slowdown", type=float, default=None, metavar="F",
                   help="slow each target forward of the edge to F times its own time (F >= 1; with "
                   "--drafter-costs, costs below the drafter's natural one, e.g. 0.3)")
    p.add_argument("--ignore-eos", action="store_true", help="every session goes on past end-of-sequence "
                   "tokens to --max-new-tokens (equal lengths at T > 0, where texts differ)")
    p.add_argument("--control", action="store_true", help="run edge-only a second time in each cell: its "
                   "ratio to edge-only is the host's noise, and the summary judges issue 46's goals with it in "
                   "auto's place (what a goal at that precision can tell apart in this run)")
    p.add_argument("--replot", type=Path, default=None, help="redo analysis and plots of a finished run's dir")
    p.add_argument("--matrix", type=Path, nargs="+", default=None, metavar="DIR",
                   help="issue 46's goals over finished runs' dirs together (bench/traces/matrix.py)")
    return p.parse_args(argv)


def settings_from(a) -> plan.Settings:
    s = plan.Settings.preset(a.quick)
    kw: dict = {}
    if a.only:
        kw["only"] = tuple(x for x in a.only.split(",") if x)
    if a.rtts:
        kw["rtts_ms"] = tuple(float(x) for x in a.rtts.split(","))
    if a.temperatures:
        kw["temperatures"] = tuple(float(x) for x in a.temperatures.split(","))
    if a.prompts:
        kw["prompts"] = a.prompts
    if a.max_new_tokens:
        kw["max_new_tokens"] = a.max_new_tokens
    if a.queue:
        kw["queue"] = parse_queue(a.queue)
    if a.check_seconds is not None:
        kw["check_seconds"] = a.check_seconds
    if a.drafter_costs:
        costs = tuple(None if x == "natural" else float(x) for x in a.drafter_costs.split(","))
        if any(c is not None and not 0 < c <= 10 for c in costs):
            raise ValueError(f"--drafter-costs: each 'natural' or in (0, 10], got {a.drafter_costs}")
        kw["drafter_costs"] = costs
    if a.ignore_eos:
        kw["ignore_eos"] = True
    if a.control:
        kw["control"] = True
    if a.target_slowdown is not None:
        if not 1 <= a.target_slowdown <= MAX_TARGET_SLOWDOWN:
            raise ValueError(f"--target-slowdown: in [1, {MAX_TARGET_SLOWDOWN:g}], got {a.target_slowdown:g}")
        kw["target_slowdown"] = a.target_slowdown
    return replace(s, **kw)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.matrix:
        return print_matrix_of(a.matrix)
    if a.replot:
        data = json.loads(gzip.open(a.replot / "bench_traces.json.gz").read())
        finish(data, a.replot)
        return 0
    try:
        s = settings_from(a)
    except ValueError as exc:
        print(f"bench-traces: {exc}", file=sys.stderr)
        return 2
    folder = plan.find_traces(a.traces)
    if folder is None:
        where = a.traces or " or ".join(str(p) for p in plan.DEFAULT_TRACES)
        print(f"bench-traces: no trace pairs (NAME.up with NAME.down) in {where}", file=sys.stderr)
        return 2
    why = shaping_available()
    if why:
        print(f"bench-traces needs the namespaces: {why}", file=sys.stderr)
        return 2
    recs = plan.recordings(folder, s)
    if not recs:
        print(f"bench-traces: no trace in {folder} matches --only {a.only}", file=sys.stderr)
        return 2
    best, best_why = plan.best_fixed_of_links_grid()
    configs = ["none", plan.DEFAULT, best, "auto"] + ([analyze.CONTROL] if s.control else [])
    extra = {"auto": {"round_log": True}}
    stamp = harness_plan.stamp(s.quick)
    out = harness_plan.run_dir(RESULTS, stamp)
    n = len(recs) * len(s.rtts_ms) * len(s.temperatures) * s.prompts * len(configs) * max(1, len(s.drafter_costs))
    print(f"bench-traces {'quick' if s.quick else 'full'}: traces {', '.join(r.name for r in recs)} from {folder}; "
          f"RTT {', '.join(f'{x:g}' for x in s.rtts_ms)} ms; T {', '.join(f'{x:g}' for x in s.temperatures)}; "
          f"{s.prompts} prompt(s) x {s.max_new_tokens} tokens; configs {', '.join(configs)} "
          f"({best}: {best_why}); {n} sessions"
          + (f"; target slowed {s.target_slowdown:g}x" if s.target_slowdown != 1 else "")
          + ("; every session to its last token past end-of-sequence (--ignore-eos)" if s.ignore_eos else ""), flush=True)
    run = Run(s, recs, configs, extra, out)
    data = {"started": stamp, "settings": s.to_json(), "traces_folder": str(folder), "configs": configs,
            "best_fixed": best, "best_fixed_why": best_why, "default": plan.DEFAULT,
            "recordings": [vars(r) for r in recs], "machine": harness_plan.machine_info(),
            "git": harness_plan.git_info(), "cells": run.cells, "sessions": run.sessions, "errors": run.errors,
            "warmup": run.warmup, "timing": {}}
    t0 = time.perf_counter()
    try:
        if s.check_seconds > 0:
            print("emulator check (loopback, saturating stream):", flush=True)
            data["trace_check"] = check_traces(recs, s.check_seconds)
        with Rig(out / "logs", link="emulated", target_slowdown=s.target_slowdown) as rig:
            data["timing"]["setup"] = time.perf_counter() - t0
            data["draft_model"] = rig.draft_model
            rig.set_rates(0.0, 0.0)  # the traces carry the capacity
            print(f"rig up in {data['timing']['setup']:.0f} s (drafter {rig.draft_model})", flush=True)
            run.warm_up(rig)
            data["calibration"] = cal = run.calibrate(rig)
            print(f"drafter {cal['drafter_token_s'] * 1e3:.1f} ms per draft token, target "
                  f"{cal['target_token_s'] * 1e3:.1f} ms per token (cost {cal['drafter_cost']:.2f}x)", flush=True)
            run.run(rig, best, cal["delays_s"])
    finally:
        data["timing"]["total"] = time.perf_counter() - t0
        data["machine"]["loadavg_end"] = list(os.getloadavg())
        write(data, out)
    finish(data, out)
    print(f"wall {data['timing']['total'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
