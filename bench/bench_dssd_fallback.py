"""Benchmark: what a DSSD fallback costs downlink, whole p_j against its head and tail samples.

After a DSSD rejection at position j the edge sends m samples y ~ p_j; when all m fail (each is kept
with probability R = TV(p_j, q_j)), the device needs more of p_j. The whole p_j is 8 bytes per
vocabulary entry; the head fallback (common/verification.py, ``dssd_edge_head``) sends p_j's K
largest entries, the tail's mass and n samples of the tail, and runs out (one more trip, for the whole
p_j) with probability ((T - R_T) / (R_H + T))^n. This computes both exactly, without sampling noise,
on texts the target samples at ``--temperature`` from the bench prompts (the real target and
drafter): at each position the chance that a tested draft is rejected there (R), that its rejection
falls back ((1 - R)^m), and for each K and n the head reply's size on the wire and its run-out
chance; averaged over rejections.

    .venv/bin/python -m specdec.bench.bench_dssd_fallback [--temperature 1] [--prompts 6] [--max-new-tokens 64]

Writes results/bench_dssd_fallback_T<temperature>.json (``--out``) and prints a table.
"""
from __future__ import annotations

import argparse
import sys

import torch

from specdec.bench import bench_truncation as bt
from specdec.common import protocol as P
from specdec.common import verification as V
from specdec.common import wire
from specdec.common.codecs import encode_target_probs


SAMPLES = (8, 64)                 # m: DSSD's default, and mode auto's (device/auto.py AutoConfig)
TOP_KS = (16, 64, 256, 1024)    # dssd_fallback_top_k
TAIL_SAMPLES = (8, 32, 64, 128)  # n


def run_out(p: torch.Tensor, q: torch.Tensor, head_ids: torch.Tensor, n: int) -> float:
    """P(a head fallback's n tail samples all fail before a token is kept): ((T - R_T) / G)^n, with
    G = R_H + T the envelope's mass (``dssd_device_resolve_head``). p, q: [V]; head_ids: [K]."""
    excess = torch.clamp(p - q, min=0.0)  # [V]
    in_head = torch.zeros_like(p, dtype=torch.bool)
    in_head[head_ids] = True
    r_head, tail, r_tail = float(excess[in_head].sum()), float(p[~in_head].sum()), float(excess[~in_head].sum())
    if r_head + tail <= 0:
        return 0.0
    return ((tail - r_tail) / (r_head + tail)) ** n


def reply_bytes(p: torch.Tensor, head: V.DssdHead | None = None) -> int:
    """Serialized EdgeMessage of a fallback: the head reply (``head``) or the whole p_j (None)."""
    whole = head is None
    reply = P.ResidualReply(1, target_probs=encode_target_probs(p)) if whole else P.ResidualReply(1, **head.to_values())
    return wire.residual_to_pb(reply).ByteSize()


def measure(a: argparse.Namespace) -> dict:
    target, drafter, prompts = bt.load_pair_and_prompts(a)
    g = torch.Generator().manual_seed(a.seed)
    rejections, whole = 0.0, None
    fallbacks = {m: 0.0 for m in SAMPLES}  # sum over positions of R (1 - R)^m
    # per (m, K, n): sums over positions, weighted by R (1 - R)^m, of bytes and run-out chance
    acc = {(m, k, n): [0.0, 0.0] for m in SAMPLES for k in TOP_KS for n in TAIL_SAMPLES}
    positions = 0
    for p, q in bt.positions(target, drafter, prompts, a.temperature, a.max_new_tokens):
        positions += 1
        p, q = p.double(), q.double()
        r = float(torch.clamp(p - q, min=0.0).sum())  # P(a draft from q is rejected here) = TV(p, q)
        rejections += r
        whole = whole or reply_bytes(p)
        for k in TOP_KS:
            for n in TAIL_SAMPLES:
                head = V.dssd_edge_head(p, k, n, g)  # what the edge would send
                size, out = reply_bytes(p, head), run_out(p, q, head.head_ids, n)
                for m in SAMPLES:
                    w = r * (1 - r) ** m
                    acc[(m, k, n)][0] += w * size
                    acc[(m, k, n)][1] += w * out
        for m in SAMPLES:
            fallbacks[m] += r * (1 - r) ** m
    rows = []
    for (m, k, n), (size, out) in acc.items():
        fb = fallbacks[m]
        head_bytes, run_out_share = size / fb, out / fb
        rows.append({"samples": m, "top_k": k, "tail_samples": n, "head_reply_bytes": head_bytes,
                     "run_out_share": run_out_share,
                     "bytes_per_fallback": head_bytes + run_out_share * whole,
                     "trips_per_fallback": 1 + run_out_share})
    return {"positions": positions, "rejection_rate": rejections / positions,
            "fallback_share": {str(m): fallbacks[m] / rejections for m in SAMPLES},
            "whole_reply_bytes": whole, "rows": rows, "drafter": drafter.name, "target": target.name}


def main(argv: list[str] | None = None) -> int:
    a = bt._args(argv, __doc__)
    res, out = bt.run(a, measure, "bench_dssd_fallback")
    print(f"T = {a.temperature:g}: {res['positions']} positions, rejection rate {res['rejection_rate']:.4f}, "
          f"whole p_j {res['whole_reply_bytes']} bytes")
    for m, share in res["fallback_share"].items():
        print(f"  m = {m}: {share:.3f} of rejections fall back")
    for row in res["rows"]:
        print(f"  m {row['samples']:3d} K {row['top_k']:5d} n {row['tail_samples']:3d}: head reply "
              f"{row['head_reply_bytes']:8.0f} B, runs out {row['run_out_share']:.4f}, "
              f"{row['bytes_per_fallback']:8.0f} B and {row['trips_per_fallback']:.3f} trips per fallback")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
