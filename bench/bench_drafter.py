"""Benchmark: the default pair (drafter on the device, target on the edge) against the target alone.

One run, same machine, same prompts (bench/prompts.jsonl: chat, code, facts, stories), one torch
thread per process. For each temperature and each prompt, interleaved so that load on the shared
cores hits both sides alike:
  * target alone: transformers ``generate`` with its KV cache (greedy at T = 0, plain sampling at
    T = 1: no top-k / top-p), in this process;
  * the pair: a ``device-client --json`` subprocess against an ``edge-server`` subprocess on loopback.
Both stop at EOS or ``--max-new-tokens``. Reported per temperature: acceptance rate, mean accepted
length, cost ratio c = T_draft / T_target per token, measured speedup (tokens/s of the pair over
tokens/s of the target), and the oracle model's predicted speedup ("Fast Collaborative Inference via Distributed Speculative Decoding", eq. 5, 8, 10) from
the same measured parts, also extended to the device drafting ahead (latency.oracle_time_drafting_ahead)
with the measured share of rounds whose drafting began during the previous verify. At T = 0 the
pair's tokens must equal the target's greedy tokens.

The target alone gets one thread, as the edge does (the two hosts' shares of this machine: one core
each); ``--target-threads 2`` gives it the whole machine instead.

    .venv/bin/python -m specdec.bench.bench_drafter [--limit N | --per-category N] [--max-new-tokens 128]
        [--draft-len L] [--target-threads T] [--edge-threads T] [--out FILE] [-- device-client flags]

Writes results/bench_drafter.json (and prints a summary table).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.bench.harness.plan import PROMPTS, RESULTS, first_per_category, load_prompts
from specdec.bench.harness.rig import Edge
from specdec.device.latency import (expected_tokens_per_call, oracle_time, oracle_time_drafting_ahead,
                                    predicted_speedup)
from specdec.common.modeling import ModelSpec, encode_prompt, load_model
from specdec.device.factory import DeviceConfig, choose_drafter

THREADS = 1                  # one torch thread per process: the cores are shared with the other side
WARMUP_TOKENS = 8            # one short untimed generation per side warms caches and allocators


def run_pair(bindir: Path, port: int, prompt: str, temperature: float, max_new: int, seed: int,
             extra: list[str]) -> dict:
    cmd = [str(bindir / "device-client"), "--edge", f"127.0.0.1:{port}", "--prompt", prompt,
           "--max-new-tokens", str(max_new), "--temperature", str(temperature), "--seed", str(seed),
           "--threads", str(THREADS), "--json", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"device-client failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


@torch.inference_mode()
def run_target(target, prompt_ids: list[int], temperature: float, max_new: int, seed: int) -> dict:
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                 top_k=0, top_p=1.0)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                min_new_tokens=0, eos_token_id=list(target.eos_token_ids),
                                pad_token_id=target.eos_token_ids[0], use_cache=True, **kwargs)
    wall = time.perf_counter() - t0
    new = [int(t) for t in out[0, len(prompt_ids):]]
    return {"token_ids": new, "wall_seconds": wall}


def summarize(temperature: float, L: int, pairs: list[dict], alone: list[dict],
              greedy_mismatch: int | None) -> dict:
    """Per-temperature totals and the oracle prediction from the measured parts."""
    s = [p["stats"] for p in pairs]
    tot = lambda key: sum(x[key] for x in s)                                # noqa: E731
    tim = lambda key: sum(x["time"][key] for x in s)                        # noqa: E731
    rounds, drafted, accepted = tot("rounds"), tot("draft_tokens"), tot("accepted_tokens")
    verified = tot("positions_verified")
    pair_tokens, pair_wall = tot("generated_tokens"), tot("wall_seconds")
    alone_tokens = sum(len(a["token_ids"]) for a in alone)
    alone_wall = sum(a["wall_seconds"] for a in alone)
    t_target = alone_wall / alone_tokens                      # s per token, target alone (incl. prefill)
    t_draft = (tim("draft") + tim("encode")) / drafted       # s per drafted token on the device
    t_verify = tim("verify") / rounds                         # edge time per round (decode + forward + verify)
    t_comm = tim("network") / rounds                          # round trip minus edge time
    # eq. (8) wants the per-token acceptance probability: accepted / positions the edge tested
    # (drafts after a rejection are never tested); accepted / drafted is lower and not that alpha.
    alpha = accepted / verified
    hit_rate = sum(x["draft_ahead"]["rounds_used"] for x in s) / rounds  # rounds whose drafting began early
    parts = L * t_draft + t_comm + t_verify
    other = pair_wall / rounds - parts                        # per round, not in any part (loop, prefill)
    return {
        "temperature": temperature,
        "prompts": len(pairs),
        "acceptance_rate": alpha,
        "accepted_per_drafted": accepted / drafted,
        "mean_accepted_length": accepted / rounds,
        "tokens_per_round": pair_tokens / rounds,
        "draft_len": L,                                       # configured (the last rounds may send fewer)
        "cost_ratio_c": t_draft / t_target,
        "target_tokens_per_second": alone_tokens / alone_wall,
        "pair_tokens_per_second": pair_tokens / pair_wall,
        "measured_speedup": (pair_tokens / pair_wall) / (alone_tokens / alone_wall),
        # eq. (5), (8), (10) with measured parts; the verify call is the edge's measured time per round
        "oracle_predicted_speedup": expected_tokens_per_call(alpha, L) * t_target / oracle_time(L, t_draft, t_comm, t_verify),
        # the paper's own form, which assumes a verify call costs one target step (T_LLM = t_target)
        "oracle_paper_form_speedup": predicted_speedup(alpha, L, t_draft, t_target, t_comm),
        # eq. (5) extended to drafting ahead (latency.oracle_time_drafting_ahead), measured hit rate
        "draft_ahead_hit_rate": hit_rate,
        "oracle_drafting_ahead_speedup": expected_tokens_per_call(alpha, L) * t_target /
        oracle_time_drafting_ahead(L, t_draft, t_comm, t_verify, hit_rate),
        "seconds_per_token": {"target": t_target, "draft": t_draft},
        "seconds_per_round": {"draft": L * t_draft, "network": t_comm, "verify": t_verify, "other": other},
        "generated_tokens": {"pair": pair_tokens, "target": alone_tokens},
        "uplink_bytes_per_round": tot("uplink_bytes") / rounds,
        "downlink_bytes_per_round": tot("downlink_bytes") / rounds,
        "greedy_mismatches": greedy_mismatch,
        "draft_model": pairs[0].get("draft_model"),
    }


def _default_draft_len() -> int:
    """device-client's L with no flag: the default drafter's recorded one."""
    cfg = DeviceConfig()
    return cfg.hello("", 1, 0, operating_point=choose_drafter(cfg).operating_point).draft.draft_len


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, default=PROMPTS)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--per-category", type=int, default=0,
                   help="first N prompts of each category only (0 = all): a quicker run that keeps the mix")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-len", type=int, default=_default_draft_len(),
                   help="draft length L of the pair (default: device-client's default)")
    p.add_argument("--target-threads", type=int, default=THREADS,
                   help="torch threads of the target-alone baseline (default 1, the edge's; 2 = the whole "
                        "machine, which the pair's two processes share)")
    p.add_argument("--edge-threads", type=int, default=THREADS,
                   help="torch threads of the pair's edge-server (default 1; 2 lets a verify use both cores "
                        "while it competes with the drafter for them)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_drafter.json")
    p.add_argument("device_args", nargs="*", help="extra device-client flags (after --)")
    a = p.parse_args()
    torch.set_num_threads(a.target_threads)
    prompts = load_prompts(a.prompts)
    prompts = first_per_category(prompts, a.per_category) if a.per_category else prompts
    prompts = prompts[:a.limit] if a.limit else prompts
    bindir = Path(sys.executable).parent
    target = load_model(ModelSpec())
    edge = Edge(threads=a.edge_threads)
    port = edge.port
    device_args = ["--draft-len", str(a.draft_len), *a.device_args]
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": THREADS,
                           "target_alone_threads": a.target_threads,
                           "edge_threads": a.edge_threads,
                           "loadavg_at_start": os.getloadavg()},
               "max_new_tokens": a.max_new_tokens, "device_args": device_args, "per_temperature": []}
    try:
        warm_ids = encode_prompt(target.tokenizer, prompts[0]["prompt"], raw=False)
        run_target(target, warm_ids, 0.0, WARMUP_TOKENS, a.seed)
        run_pair(bindir, port, prompts[0]["prompt"], 0.0, WARMUP_TOKENS, a.seed, device_args)
        for temperature in a.temperatures:
            pairs, alone, rows = [], [], []
            mismatches = 0
            for i, item in enumerate(prompts):
                ids = encode_prompt(target.tokenizer, item["prompt"], raw=False)
                t = run_target(target, ids, temperature, a.max_new_tokens, a.seed + i)
                r = run_pair(bindir, port, item["prompt"], temperature, a.max_new_tokens, a.seed + i,
                             device_args)
                same = r["token_ids"] == t["token_ids"]
                mismatches += temperature == 0 and not same
                alone.append(t)
                pairs.append(r)
                st = r["stats"]
                rows.append({"category": item["category"], "prompt": item["prompt"],
                             "target_tokens": len(t["token_ids"]), "target_seconds": t["wall_seconds"],
                             "pair_tokens": st["generated_tokens"], "pair_seconds": st["wall_seconds"],
                             "acceptance_rate": st["acceptance_rate"], "same_tokens": same})
                print(f"T={temperature:g} [{i + 1}/{len(prompts)}] {item['category']:7s} "
                      f"alone {len(t['token_ids']) / t['wall_seconds']:5.1f} tok/s  "
                      f"pair {st['generated_tokens'] / st['wall_seconds']:5.1f} tok/s  "
                      f"accept {st['acceptance_rate']:.2f}" + ("" if same or temperature else "  MISMATCH"),
                      flush=True)
            summary = summarize(temperature, a.draft_len, pairs, alone, mismatches if temperature == 0 else None)
            summary["per_prompt"] = rows
            results["per_temperature"].append(summary)
    finally:
        edge.stop()
    results["machine"]["loadavg_at_end"] = os.getloadavg()  # the cores are shared: how busy they were
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {a.out}")
    return 0


def print_table(results: dict) -> None:
    keys = ["acceptance_rate", "accepted_per_drafted", "mean_accepted_length", "draft_len", "cost_ratio_c",
            "target_tokens_per_second", "pair_tokens_per_second", "measured_speedup", "oracle_predicted_speedup",
            "oracle_paper_form_speedup", "draft_ahead_hit_rate", "oracle_drafting_ahead_speedup",
            "uplink_bytes_per_round"]
    print(f"\n{'':32s}" + "".join(f"T={r['temperature']:<10g}" for r in results["per_temperature"]))
    for k in keys:
        print(f"{k:32s}" + "".join(f"{r[k]:<12.3f}" for r in results["per_temperature"]))
    for r in results["per_temperature"]:
        if r["greedy_mismatches"] is not None:
            print(f"greedy outputs differing from the target's (T=0): {r['greedy_mismatches']}/{r['prompts']}")
    print(f"drafter: {results['per_temperature'][0]['draft_model']}")


if __name__ == "__main__":
    sys.exit(main())
