"""bench-coldstart: mode auto as a new user meets it, one ``device-client`` process per session
(issue 35, item 4).

    make bench-coldstart                      # RTT 0, 60, 150 ms at 10 Mbit/s, T = 1, 2 prompts x 96 tokens
    .venv/bin/python -m specdec.bench.bench_coldstart [--rtts 0,60,150] [--prompts 2] [--tokens 96]
        [--temperature 1] [--rate-mbit 10] [--repeats 1]

Needs root (namespaces). The harness rig's emulated link (tbf at the rate, 4x down; the emulator's
delay RTT / 2 each way) with ``edge-server`` on one side; on the other, for every session a fresh
``device-client --json`` process, as a user runs it: ``none`` (``--mode none``, the edge alone),
``auto-cold`` (no draft flag, so mode auto, with ``--no-edge-memory``: every process a device that
never used this edge) and ``auto-memory`` (mode auto starting from what the earlier processes of
this device learned about the edge, $SPECDEC_CACHE_DIR/edges; one unmeasured process first at each
round trip). Interleaved prompt by prompt, the same seeds for every configuration.

Writes results/bench_coldstart/<timestamp>/ (and .../latest): bench_coldstart.json (every session's
record with its round log), logs/; prints tokens/s per round trip and configuration, and the goals.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.analyze import fmt, goal, print_goals, ratio  # noqa: E402
from specdec.bench.harness.rig import Rig, shaping_available  # noqa: E402
from specdec.bench.links.plan import grid_link  # noqa: E402
from specdec.device import edge_memory  # noqa: E402
from specdec.testbed import procs  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_coldstart"
CONFIGS = {"none": ["--mode", "none"], "auto-cold": ["--no-edge-memory"], "auto-memory": []}
SESSION_TIMEOUT_S = 600.0


def run_session(rig: Rig, config: str, prompt: str, seed: int, a) -> dict:
    cmd = rig.device_cmd("--prompt", prompt, "--json", "--round-log", "--max-new-tokens", str(a.tokens),
                         "--temperature", f"{a.temperature:g}", "--seed", str(seed), *CONFIGS[config])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=SESSION_TIMEOUT_S, env=procs.child_env())
    if r.returncode != 0:
        raise RuntimeError(f"device-client failed ({config}): {r.stderr.strip()[-500:]}")
    record = json.loads(r.stdout.strip().splitlines()[-1])
    record["process_seconds"] = time.perf_counter() - t0
    return record


def cell_stats(sessions: list[dict]) -> dict[str, float]:
    """tokens/s per configuration: generated tokens / session seconds over its sessions."""
    out = {}
    for config in CONFIGS:
        mine = [s["record"]["stats"] for s in sessions if s["config"] == config]
        wall = sum(st["wall_seconds"] for st in mine)
        if wall:
            out[config] = sum(st["generated_tokens"] for st in mine) / wall
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", default="0,60,150")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rate-mbit", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    a = p.parse_args(argv)
    why = shaping_available()
    if why:
        print(f"bench-coldstart needs the namespaces: {why}", file=sys.stderr)
        return 2
    rtts = [float(x) for x in a.rtts.split(",")]
    prompts = harness_plan.sample_texts(a.prompts)
    out = harness_plan.run_dir(RESULTS, harness_plan.stamp())
    data = {"settings": vars(a), "machine": harness_plan.machine_info(), "git": harness_plan.git_info(),
            "sessions": [], "cells": {}}
    t0 = time.perf_counter()
    with Rig(out / "logs", link="emulated", driver=False) as rig:
        edge_memory.memory_path(rig.device_address).unlink(missing_ok=True)  # this edge is new to the device
        for rtt in rtts:
            link = grid_link(a.rate_mbit, rtt)
            rig.set_rates(link.up_bps, link.down_bps)
            rig.set_emulator(link.emulator())
            run_session(rig, "auto-memory", prompts[0], 999, a)  # the device meets this link once, unmeasured
            got = []
            for k in range(a.repeats):
                for i, prompt in enumerate(prompts):
                    for config in harness_plan.rotated(list(CONFIGS), i + k):
                        record = run_session(rig, config, prompt, harness_plan.SEED_BASE + i, a)
                        st = record["stats"]
                        print(f"  {link.name:<16} {config:<12} p{i} {st['generated_tokens']:>4} tok "
                              f"{st['wall_seconds']:6.2f} s {st['tokens_per_second']:6.1f} tok/s", flush=True)
                        got.append({"rtt_ms": rtt, "config": config, "prompt": i, "repeat": k, "record": record})
            data["sessions"] += got
            data["cells"][f"{rtt:g}"] = cell_stats(got)
    data["wall_s"] = time.perf_counter() - t0
    data["machine"]["loadavg_end"] = list(os.getloadavg())
    report(data, out, rtts)
    return 0


def report(data: dict, out: Path, rtts: list[float]) -> None:
    cells = data["cells"]
    print(f"\ntokens/s at {data['settings']['rate_mbit']:g} Mbit/s, T = {data['settings']['temperature']:g} "
          "(generated tokens / session seconds)")
    print(f"{'RTT ms':>8}" + "".join(f"{c:>13}" for c in CONFIGS) + f"{'cold/none':>11}{'memory/none':>13}")
    for rtt in rtts:
        c = cells[f"{rtt:g}"]
        print(f"{rtt:>8g}" + "".join(f"{fmt(c.get(k), '.1f'):>13}" for k in CONFIGS)
              + f"{fmt(ratio(c.get('auto-cold'), c.get('none'))):>11}{fmt(ratio(c.get('auto-memory'), c.get('none'))):>13}")
    lo, mid, hi = (cells.get(f"{x:g}", {}) for x in (min(rtts), 60.0, max(rtts)))
    data["goals"] = {
        "keep_60ms": goal("auto (cold, every process) at 60 ms keeps >= 80 % of its tokens/s at the lowest RTT",
                          ratio(mid.get("auto-cold"), lo.get("auto-cold")), 0.8),
        "cold_vs_none": goal("auto (cold, every process) >= 1.0x edge-only at the highest RTT (cannot lose to it)",
                             ratio(hi.get("auto-cold"), hi.get("none")), 1.0),
        "memory_vs_none": goal("auto (remembering the edge) >= 1.3x edge-only at the highest RTT (the warm grid's)",
                               ratio(hi.get("auto-memory"), hi.get("none")), 1.3),
    }
    (out / "bench_coldstart.json").write_text(json.dumps(data, indent=1, default=str))
    print_goals("issue 35 item 4", data["goals"])
    print(f"\nresults: {out}  (wall {data['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    sys.exit(main())
