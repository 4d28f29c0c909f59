"""bench-poor-drafters: eight devices whose drafters almost never guess right, at one busy edge
(issue 35, item 5).

    make bench-poor-drafters                      # 8 devices x 2 sessions x 48 tokens, T = 0, 2 passes
    .venv/bin/python -m specdec.bench.bench_poor_drafters [--devices 8] [--sessions 2] [--tokens 48]
        [--passes 2] [--modes batched,unbatched,edge-only,auto] [--edge-cpus 1|all]

Each device is a real device driver process (bench/harness/driver.py, the path of ``device-client``)
with its own tiny random drafter that shares the embedded target's tokenizer (so the edge takes its
drafts: testbed/tiny_models.make_random_drafter, seed i), all at once against one ``edge-server``
with one torch thread on loopback. Serving modes of the same devices, prompts and seeds:
``batched`` (``--mode tslt --top-k 8 --draft-len 4`` on the batching edge: the edge's load-aware
advice is all that can stop such drafts), ``unbatched`` (the same on a ``--no-batching`` edge),
``edge-only`` (``--mode none`` on the batching edge) and ``auto`` (``--mode auto``, starting each pass
knowing nothing of the link, on the batching edge). Both edges stay up (pinned to the last core, the
devices to the others, as in bench-capacity) and the modes take turns, rotated between passes.

Aggregate tokens/s of a mode = sum over devices of (its tokens / its session seconds). Writes
results/bench_poor_drafters/<timestamp>/ (and .../latest): bench_poor_drafters.json (every session,
per mode and pass, the edge's advice from its /metrics), logs/; prints the table and the goal
(batched >= 0.95x edge-only) as PASS / MISS, with auto's ratio beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench.capacity.plan import default_edge_cpus  # noqa: E402
from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.analyze import fmt, goal, print_goals, ratio  # noqa: E402
from specdec.bench.harness.rig import Drivers, Edge  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_poor_drafters"
EDGE_COMMON = ("--max-sessions-per-principal", "0")  # all devices are one host (see bench-capacity)
POOR = {"mode": "tslt", "top_k": 8, "draft_len": 4}  # the setting
MODES = {
    "batched": ("batched", POOR),
    "unbatched": ("unbatched", POOR),
    "edge-only": ("batched", {"mode": "none"}),
    "auto": ("batched", {"mode": "auto"}),
}
GOAL = ("batched, drafters that almost never guess right, >= 0.95x the same devices edge-only", 0.95)


def target_tokenizer():
    """The embedded target's tokenizer (from its dequantized copy once the edge made one)."""
    from transformers import AutoTokenizer

    from specdec.common.modeling import embedded_gguf_path, gguf_cache_dir
    gguf = embedded_gguf_path()
    cached = gguf_cache_dir(str(gguf.parent), gguf.name)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def make_drafters(root: Path, n: int) -> list[Path]:
    from transformers.utils import logging as hf_logging

    from specdec.testbed.tiny_models import make_random_drafter
    hf_logging.disable_progress_bar()
    tok = target_tokenizer()
    return [make_random_drafter(root / f"poor-{i}", tok, seed=100 + i) for i in range(n)]


def aggregate(lines: list[dict]) -> dict:
    """Sum over devices of tokens / session seconds, and the devices' own rates."""
    per: dict[int, list[float]] = {}
    for line in lines:
        st = line["record"]["stats"]
        t, w = per.setdefault(line["device"], [0, 0.0])
        per[line["device"]] = [t + st["generated_tokens"], w + st["wall_seconds"]]
    rates = {d: tw[0] / tw[1] for d, tw in per.items() if tw[1] > 0}
    return {"aggregate_tps": sum(rates.values()), "devices": len(rates), "per_device_tps": rates,
            "tokens": sum(tw[0] for tw in per.values())}


def edge_advice(edge: Edge) -> dict:
    """The edge's draft-length advice so far (histogram sum / count) from its /metrics."""
    text = edge.metrics() or ""
    out = {}
    for line in text.splitlines():
        if line.startswith("specdec_edge_draft_len_hint_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return {k: v for k, v in out.items() if k.endswith(("_sum", "_count"))}


def run_pass(k: int, modes: list[str], groups: dict[str, Drivers], prompts: list[str], a) -> list[dict]:
    sessions = []
    for mode in harness_plan.rotated(modes, k):
        edge_kind, config = MODES[mode]
        jobs = [{"id": f"{mode}|{k}|{d}", "config": {**config, "temperature": 0.0, "max_new_tokens": a.tokens},
                 "prompts": [prompts[(d * a.sessions + j) % len(prompts)] for j in range(a.sessions)],
                 "seeds": [harness_plan.SEED_BASE + d * a.sessions + j for j in range(a.sessions)],
                 "fresh_tracker": True}
                for d in range(a.devices)]
        t0 = time.perf_counter()
        lines = groups[edge_kind].run(jobs)
        got = [{**line, "mode": mode, "pass": k, "device": int(line["job"].split("|")[2])}
               for line in lines if "record" in line]
        errors = [line for line in lines if "error" in line]
        agg = aggregate(got)
        print(f"  pass {k} {mode:<10} {agg['aggregate_tps']:6.1f} tok/s aggregate over {agg['devices']} devices "
              f"({time.perf_counter() - t0:.0f} s)" + (f"; {len(errors)} errors: {errors[0]['error']}" if errors else ""),
              flush=True)
        sessions += got
    return sessions


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sessions", type=int, default=2, help="sessions per device (one after the other)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--edge-cpus", default="", help="CPUs the edges are pinned to ('all': unpinned; default the last)")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    if set(a.modes) - set(MODES) or min(a.devices, a.sessions, a.tokens, a.passes) < 1:
        p.error(f"--modes from {','.join(MODES)}; --devices, --sessions, --tokens, --passes >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    cpus = () if a.edge_cpus == "all" else tuple(int(x) for x in a.edge_cpus.split(",")) if a.edge_cpus \
        else default_edge_cpus()
    rest = os.sched_getaffinity(0) - set(cpus)
    if cpus and rest:
        os.sched_setaffinity(0, rest)  # the devices (this process's children) off the edge's core
    out = harness_plan.run_dir(RESULTS, harness_plan.stamp())
    logs = out / "logs"
    data = {"settings": vars(a), "edge_cpus": list(cpus), "machine": harness_plan.machine_info(),
            "git": harness_plan.git_info(), "sessions": []}
    t0 = time.perf_counter()
    edges, groups = {}, {}
    try:
        for kind, extra in (("batched", ()), ("unbatched", ("--no-batching",))):
            if any(MODES[m][0] == kind for m in a.modes):
                edges[kind] = Edge(*EDGE_COMMON, *extra, log=logs / f"edge-{kind}.log", cpus=cpus, metrics=True)
        drafters = make_drafters(out / "drafters", a.devices)
        for kind, edge in edges.items():
            (logs / kind).mkdir(exist_ok=True)
            groups[kind] = Drivers(edge.address, a.devices, logs / kind,
                                   args=lambda i: ("--draft-model", str(drafters[i])))
        print(f"{a.devices} devices x {len(groups)} edges up in {time.perf_counter() - t0:.0f} s; modes "
              f"{', '.join(a.modes)}; {a.sessions} x {a.tokens} tokens per device, T = 0", flush=True)
        prompts = harness_plan.sample_texts(a.devices * a.sessions)
        for k in range(a.passes):
            data["sessions"] += run_pass(k, a.modes, groups, prompts, a)
        data["edge_advice"] = {kind: edge_advice(edge) for kind, edge in edges.items()}
    finally:
        for g in groups.values():
            g.stop()
        for e in edges.values():
            e.stop()
        data["wall_s"] = time.perf_counter() - t0
        data["machine"]["loadavg_end"] = list(os.getloadavg())
    report(data, out)
    return 0


def report(data: dict, out: Path) -> None:
    modes = data["settings"]["modes"]
    passes = range(data["settings"]["passes"])
    per = {m: [aggregate([s for s in data["sessions"] if s["mode"] == m and s["pass"] == k])["aggregate_tps"]
               for k in passes] for m in modes}
    data["aggregate_tps"] = {m: sum(v) / len(v) for m, v in per.items() if v}
    edge_only = data["aggregate_tps"].get("edge-only")
    data["goals"] = {"batched_vs_edge_only": goal(GOAL[0], ratio(data["aggregate_tps"].get("batched"), edge_only),
                                                  GOAL[1], "mean of the passes' aggregates"),
                     "auto_vs_edge_only": goal("auto, the same devices, >= 0.95x edge-only",
                                               ratio(data["aggregate_tps"].get("auto"), edge_only), GOAL[1])}
    (out / "bench_poor_drafters.json").write_text(json.dumps(data, indent=1, default=str))
    print("\naggregate tok/s (sum over devices of tokens / session seconds), per pass and mean")
    for m in modes:
        print(f"  {m:<10}" + "".join(f"{x:8.1f}" for x in per[m]) + f"   mean {fmt(data['aggregate_tps'].get(m), '.1f')}"
              + f"   / edge-only {fmt(ratio(data['aggregate_tps'].get(m), edge_only))}")
    print(f"  edge advice (metrics): {data.get('edge_advice')}")
    print_goals("issue 35 item 5", data["goals"])
    print(f"\nresults: {out}  (wall {data['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    sys.exit(main())
