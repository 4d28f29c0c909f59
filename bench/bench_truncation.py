"""Benchmark: what truncating the draft distribution costs in acceptance, against eq. (22)'s estimate.

mode auto predicts the acceptance of a codec it has not tried with TSLT eq. (22) as a first-order
estimate: alpha_K = alpha_dense - sigma_K, sigma_K = TV(q_hat_K, q) (the drafter's mass outside the
K tokens sent). The bound |alpha_K - alpha_dense| <= sigma_K is tight when p = q; how close it is for
the real pair decides whether auto ranks K right. This measures it exactly, without sampling noise:
on texts the target samples at ``--temperature`` from the bench prompts, at every generated position
it computes the expected acceptance sum_x min(p, q_hat) for the drafter's dense q and for each codec
(the packet the device would send, decoded as the edge decodes it), and sigma_K.

    .venv/bin/python -m specdec.bench.bench_truncation [--temperature 1] [--prompts 6] [--max-new-tokens 64]

Writes results/bench_truncation_T<temperature>.json (``--out``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specdec.bench.harness.plan import RESULTS, load_prompts
from specdec.common.codecs import CodecConfig
from specdec.common.modes import Mode
from specdec.common.distributions import tv_distance
from specdec.common.modeling import ModelSpec, encode_prompt, load_model
from specdec.common.sampling import model_probs
from specdec.device.lean_drafter import default_drafter_spec
from specdec.device.draft_model import DraftModel, encode_q

# the codecs mode auto chooses among (device/auto.py AutoConfig) and K = 1024, which it dropped
CODECS = {**{f"tslt-{k}": (Mode.TSLT, k) for k in (16, 64, 256, 1024)}, "ksqs-64": (Mode.KSQS, 64)}


def _args(argv: list[str] | None, doc: str = __doc__) -> argparse.Namespace:
    """The flags of this bench and of those reading the same sampled texts (bench_dssd_fallback)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=6, help="first N prompts of bench/prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.temperature <= 0 or a.prompts < 1 or a.max_new_tokens < 1:
        ap.error("--temperature must be > 0, --prompts and --max-new-tokens >= 1")
    return a


def run(a: argparse.Namespace, measure_fn, name: str) -> tuple[dict, Path]:
    """``measure_fn(a)`` timed, with the run's settings, written to results/<name>_T<T>.json (``--out``)."""
    t0 = time.perf_counter()
    res = measure_fn(a)
    res.update(temperature=a.temperature, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
               machine=platform.platform(), torch=torch.__version__, seconds=time.perf_counter() - t0)
    out = a.out or RESULTS / f"{name}_T{a.temperature:g}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res, out


def acceptance(p: torch.Tensor, q_hat: torch.Tensor) -> float:  # [V], [V] -> P(a draft from q_hat is kept)
    return float(torch.minimum(p, q_hat).sum())


def positions(target, drafter, prompts: list[str], temperature: float, max_new_tokens: int):
    """(p, q) [V], [V] at every position of texts the target samples at ``temperature`` from
    ``prompts`` (its greedy decode at 0): the target's and the drafter's distributions given the same
    prefix."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    for text in prompts:
        ids = encode_prompt(target.tokenizer, text, raw=False)
        with torch.no_grad():
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **sampling)
            logits = target.model(out).logits[0]  # [len, V]
        seq, draft = out[0].tolist(), DraftModel(drafter, temperature)
        for i in range(len(ids), len(seq)):
            yield model_probs(logits[i - 1], temperature), draft.probs(draft.feed(seq[:i]))


def load_pair_and_prompts(a: argparse.Namespace):
    """The embedded target and drafter, and the first ``a.prompts`` bench prompts."""
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    target, drafter = load_model(ModelSpec()), load_model(default_drafter_spec())
    prompts = [row["prompt"] for row in load_prompts()]
    return target, drafter, prompts[:a.prompts]


def measure(a: argparse.Namespace) -> dict:
    target, drafter, prompts = load_pair_and_prompts(a)
    V = drafter.vocab_size
    codecs = {name: CodecConfig(mode=mode, vocab_size=V, top_k=k, lattice=1000) for name, (mode, k) in CODECS.items()}
    sums = {name: [0.0, 0.0] for name in ("dense", *codecs)}  # [sum acceptance, sum sigma]
    n = 0
    for p, q in positions(target, drafter, prompts, a.temperature, a.max_new_tokens):
        sums["dense"][0] += acceptance(p, q)
        for name, codec in codecs.items():
            q_hat = encode_q(q, codec).q_hat
            sums[name][0] += acceptance(p, q_hat)
            sums[name][1] += tv_distance(q_hat, q)
        n += 1
    dense = sums["dense"][0] / n
    rows = {name: {"acceptance": s / n, "sigma": g / n, "loss": dense - s / n,
                   "loss_over_sigma": (dense - s / n) / (g / n) if g else None}
            for name, (s, g) in sums.items() if name != "dense"}
    return {"positions": n, "dense_acceptance": dense, "codecs": rows, "drafter": drafter.name,
            "target": target.name}


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    res, out = run(a, measure, "bench_truncation")
    print(f"T = {a.temperature:g}: {res['positions']} positions, dense q acceptance {res['dense_acceptance']:.4f}")
    for name, r in res["codecs"].items():
        print(f"  {name:10s} sigma {r['sigma']:.4f}  acceptance {r['acceptance']:.4f}  loss {r['loss']:.4f}"
              f"  loss / sigma {r['loss_over_sigma']:.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
