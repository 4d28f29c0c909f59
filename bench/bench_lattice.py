"""Benchmark of the exact enumerative coding in specdec.common.lattice (not a timed test).

Prints the median encode and decode times (wall clock and thread CPU time) of the K-SQS support (subset index) and lattice
counts (composition index) for a few (K, ell, V) cases, plus the whole ksqs packet codec, and
writes them to results/bench_lattice.json.

    .venv/bin/python -m specdec.bench.bench_lattice [--runs 300]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec.common import lattice
from specdec.common.codecs import CodecConfig, decode_distribution, encode_distribution
from specdec.common.modes import Mode
from specdec.common.distributions import probs_from_logits

# (K, ell, V): the acceptance case first (Qwen2-size vocabulary), then smaller and larger ones.
CASES = [(256, 1000, 152_064), (64, 1000, 152_064), (256, 100, 32_000), (1024, 1000, 152_064)]
# Distinct random vectors cycled through, so no single lucky input sets the timing.
NUM_VECTORS = 16
# Logit scale of the synthetic draft distributions (peaked like a small LM at temperature 1).
LOGIT_SCALE = 4.0


def make_inputs(K: int, ell: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids of a random distribution over V (spread over the vocabulary) and their counts."""
    g = torch.Generator().manual_seed(seed)
    q = probs_from_logits(torch.randn(V, generator=g) * LOGIT_SCALE, 1.0)
    top = torch.topk(q, K)
    ids, order = top.indices.sort()
    probs = top.values[order].double()
    return ids, lattice.quantize(probs / probs.sum(), ell)


def median_ms(fn, args_list, runs: int) -> float:
    """Median wall-clock milliseconds per call (perf_counter), and CPU milliseconds (thread time).

    The machine is shared: when other processes compete for the cores, wall time inflates while
    the thread's CPU time stays close to what an idle core would give; both are reported.
    """
    wall, cpu = [], []
    for i in range(runs):
        args = args_list[i % len(args_list)]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(*args)
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
    return statistics.median(wall) / 1e6, statistics.median(cpu) / 1e6


def bench_case(K: int, ell: int, V: int, runs: int) -> dict:
    inputs = [make_inputs(K, ell, V, seed) for seed in range(NUM_VECTORS)]
    subsets = [(lattice.encode_subset(ids, V),) for ids, _ in inputs]
    comps = [(lattice.encode_composition(b, ell),) for _, b in inputs]
    for (ids, b), (s,), (c,) in zip(inputs, subsets, comps):  # correctness, and warm caches
        assert torch.equal(lattice.decode_subset(s, K, V), ids)
        assert torch.equal(lattice.decode_composition(c, K, ell), b)
    result = {"K": K, "ell": ell, "V": V, "runs": runs,
              "subset_bits": lattice.subset_bits(K, V), "composition_bits": lattice.composition_bits(K, ell)}
    timed = {
        "encode_subset": (lambda ids: lattice.encode_subset(ids, V), [(i,) for i, _ in inputs]),
        "decode_subset": (lambda s: lattice.decode_subset(s, K, V), subsets),
        "encode_composition": (lambda b: lattice.encode_composition(b, ell), [(b,) for _, b in inputs]),
        "decode_composition": (lambda c: lattice.decode_composition(c, K, ell), comps),
    }
    for name, (fn, args_list) in timed.items():
        result[f"{name}_ms"], result[f"{name}_cpu_ms"] = median_ms(fn, args_list, runs)
    for clock in ("ms", "cpu_ms"):
        result[f"encode_{clock}"] = result[f"encode_subset_{clock}"] + result[f"encode_composition_{clock}"]
        result[f"decode_{clock}"] = result[f"decode_subset_{clock}"] + result[f"decode_composition_{clock}"]
    return result


def bench_codec(K: int, ell: int, V: int, runs: int) -> dict:
    """Whole ksqs packet: top-K selection over V, quantization, both indices, bytes; and decode."""
    cfg = CodecConfig(Mode.KSQS, V, top_k=K, lattice=ell)
    qs = [(probs_from_logits(torch.randn(V, generator=torch.Generator().manual_seed(s)) * LOGIT_SCALE, 1.0),)
          for s in range(NUM_VECTORS)]
    payloads = [(encode_distribution(q, cfg).payload,) for (q,) in qs]
    result = {"K": K, "ell": ell, "V": V, "payload_bytes": len(payloads[0][0])}
    result["encode_distribution_ms"], result["encode_distribution_cpu_ms"] = median_ms(
        lambda q: encode_distribution(q, cfg), qs, runs)
    result["decode_distribution_ms"], result["decode_distribution_cpu_ms"] = median_ms(
        lambda p: decode_distribution(p, cfg), payloads, runs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="timed calls per measurement")
    parser.add_argument("--out", type=Path, default=Path("results/bench_lattice.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = []
    for K, ell, V in CASES:
        runs = args.runs if K <= 256 else max(args.runs // 10, 10)
        r = bench_case(K, ell, V, runs)
        cases.append(r)
        print(f"K={K:5d} ell={ell:5d} V={V:7d} bits {r['subset_bits']}+{r['composition_bits']}: "
              f"encode {r['encode_ms']:.3f} ms (cpu {r['encode_cpu_ms']:.3f}; subset {r['encode_subset_cpu_ms']:.3f} "
              f"+ comp {r['encode_composition_cpu_ms']:.3f}), decode {r['decode_ms']:.3f} ms "
              f"(cpu {r['decode_cpu_ms']:.3f}; subset {r['decode_subset_cpu_ms']:.3f} "
              f"+ comp {r['decode_composition_cpu_ms']:.3f})")
    codec = bench_codec(*CASES[0], runs=max(args.runs // 3, 10))
    print(f"ksqs packet K={codec['K']} ell={codec['ell']} V={codec['V']}: {codec['payload_bytes']} bytes, "
          f"encode_distribution {codec['encode_distribution_ms']:.3f} ms (cpu {codec['encode_distribution_cpu_ms']:.3f}), "
          f"decode_distribution {codec['decode_distribution_ms']:.3f} ms (cpu {codec['decode_distribution_cpu_ms']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "statistic": "median over runs, milliseconds; *_cpu_ms = thread CPU time, the rest wall clock",
            "load_average_1min": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    args.out.write_text(json.dumps({"meta": meta, "cases": cases, "ksqs_codec": codec}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
