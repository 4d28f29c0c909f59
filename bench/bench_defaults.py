"""Benchmark: `edge-server` + `device-client` with no tuning flags against the target alone.

What a newcomer runs on one host: an edge-server and a device-client with no flag but the address,
prompt, token budget and --json (output format only), and $OMP_NUM_THREADS unset, so the thread rule
of common/runtime.py decides. Against transformers ``generate`` with torch's default threads (every
core). Greedy (device-client's default), the first prompt of each category of bench/prompts.jsonl,
interleaved pair / target prompt by prompt, ``--repeats`` times; medians reported. The pair's time
is the device's wall clock from the prompt to the last token (model loading excluded), the target's
one generate call after a warm-up (demo.time_generate).

    .venv/bin/python -m specdec.bench.bench_defaults [--repeats 3] [--max-new-tokens 64] [--out FILE]

Writes results/bench_defaults.json and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.bench.harness.plan import RESULTS, first_per_category, load_prompts
from specdec.common.modeling import ModelSpec, encode_prompt, load_model
from specdec.common.runtime import usable_cores
from specdec.device.demo import start_edge, time_generate

BINDIR = Path(sys.executable).parent


def _untuned_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _prompts() -> list[str]:
    return [row["prompt"] for row in first_per_category(load_prompts(), 1)]


def _tps(run: dict) -> float:
    return len(run["token_ids"]) / run["wall_seconds"]


def run_pair(port: int, prompt: str, max_new: int) -> dict:
    cmd = [str(BINDIR / "device-client"), "--edge", f"127.0.0.1:{port}", "--prompt", prompt,
           "--max-new-tokens", str(max_new), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=_untuned_env())
    if run.returncode != 0:
        raise RuntimeError(f"device-client failed: {run.stderr.strip()[-2000:]}")
    record = json.loads(run.stdout.strip().splitlines()[-1])
    thread_line = next((line for line in run.stderr.splitlines() if "torch thread" in line), "")
    return {"token_ids": record["token_ids"], "wall_seconds": record["stats"]["wall_seconds"],
            "acceptance_rate": record["stats"]["acceptance_rate"], "thread_line": thread_line}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS / "bench_defaults.json"))
    a = p.parse_args()
    prompts = _prompts()
    target = load_model(ModelSpec())
    threads = usable_cores()  # torch's default for a lone process: every core
    edge, port = start_edge([], env=_untuned_env())
    rows = []
    try:
        for rep in range(a.repeats):
            for i, prompt in enumerate(prompts):
                pair = run_pair(port, prompt, a.max_new_tokens)
                ids = encode_prompt(target.tokenizer, prompt, raw=False)
                alone = time_generate(target, ids, a.max_new_tokens, 0.0, 0, threads)
                rows.append({"repeat": rep, "prompt": i, "pair": pair, "target": alone,
                             "same_tokens": pair["token_ids"] == alone["token_ids"]})
                print(f"repeat {rep} prompt {i}: pair {_tps(pair):.1f} tok/s, target alone {_tps(alone):.1f} tok/s",
                      flush=True)
    finally:
        edge.terminate()
        edge.wait(timeout=30)
    summary = summarize(rows, threads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


def summarize(rows: list[dict], threads: int) -> dict:
    """Medians over every (repeat, prompt) pair of runs, and the per-repeat totals the issue quoted."""
    tps = _tps
    ratios = [tps(r["pair"]) / tps(r["target"]) for r in rows]
    totals = {}
    for r in rows:
        t = totals.setdefault(r["repeat"], [0.0, 0.0])
        t[0] += r["pair"]["wall_seconds"]
        t[1] += r["target"]["wall_seconds"]
    return {
        "sessions": len(rows), "cores": usable_cores(), "target_threads": threads,
        "pair_thread_line": rows[0]["pair"]["thread_line"] if rows else "",
        "median_pair_tokens_per_second": statistics.median(tps(r["pair"]) for r in rows),
        "median_target_tokens_per_second": statistics.median(tps(r["target"]) for r in rows),
        "median_speedup": statistics.median(ratios),
        "speedups": [round(x, 3) for x in ratios],
        "median_total_seconds_pair": statistics.median(t[0] for t in totals.values()),
        "median_total_seconds_target": statistics.median(t[1] for t in totals.values()),
        "greedy_mismatches": sum(not r["same_tokens"] for r in rows),
        "median_acceptance": statistics.median(r["pair"]["acceptance_rate"] for r in rows),
    }


if __name__ == "__main__":
    sys.exit(main())
