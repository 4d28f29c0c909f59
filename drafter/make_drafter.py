"""`make drafter`: teacher data -> distillation -> committed delta weights -> what they achieve.

Steps (fixed seed; about an hour on one core of the project's 2-core CPUs):
  1. gen_data: the target answers templated prompts (half greedy, half sampled at T = 1), keeping
     its top-K log-probabilities at every generated position;
  2. train: distil the student (train.py docstring) on 95% of the answers;
  3. save the delta to device/drafter_weights/ (only what differs from the target);
  4. load it back through the device's own loading path (int8 as the device runs it) and measure on
     the held-out answers: acceptance at T = 0 and T = 1, the cost ratio c = T_draft / T_target
     per token (one torch thread, interleaved timings), and the oracle model's predicted speedup
     per draft length L, with the verify call timed as a forward over L + 1 tokens.

    .venv/bin/python drafter/make_drafter.py [--reuse-data] [--steps N] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_data import GenConfig, generate_dataset  # noqa: E402
from train import TrainConfig, make_example, make_true_p, split, train  # noqa: E402
from train_prompts import load_bench_prompts, training_prompts  # noqa: E402

from specdec.common.engine import model_probs  # noqa: E402
from specdec.common.latency import expected_tokens_per_call, oracle_time  # noqa: E402
from specdec.common.modeling import CachedLM, ModelSpec, load_model  # noqa: E402
from specdec.device.default_drafter import WEIGHTS_DIR, default_drafter_spec, save_drafter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "build" / "drafter" / "data.pt"
TIMING_REPS = 40          # interleaved forwards per timed quantity (medians)
CONTEXT_TOKENS = 64       # cached context before the timed forwards (a typical mid-answer length)
DRAFT_LENS = range(1, 9)  # draft lengths the oracle model is evaluated at


@torch.no_grad()
def heldout_acceptance(drafter, held: list[dict]) -> dict:
    """alpha_t0 / alpha_t1 of the loaded drafter (full-vocabulary logits) on held-out answers."""
    hits = n0 = 0
    overlap = 0.0
    n1 = 0
    for e in held:
        logits = drafter.model(input_ids=e["ids"][None]).logits[0, e["pos"]]      # [n, V]
        if e["greedy"]:
            hits += int((logits.argmax(-1) == e["top_full"]).sum())
            n0 += len(e["pos"])
        else:
            q = model_probs(logits, 1.0)
            overlap += float(torch.minimum(e["p_full"], q.gather(-1, e["ids_full"])).sum())
            n1 += len(e["pos"])
    return {"alpha_t0": hits / max(n0, 1), "alpha_t1": overlap / max(n1, 1)}


def _median_forward(lm: CachedLM, n_new: int, temperature: float | None) -> float:
    base = lm.cache_len
    t0 = time.perf_counter()
    logits = lm.forward(list(range(1000, 1000 + n_new)), num_logits=n_new)
    if temperature is not None:
        model_probs(logits[-1], temperature)
    dt = time.perf_counter() - t0
    lm.truncate(base)
    return dt


def measure_costs(drafter, target, max_l: int) -> dict:
    """Median seconds: drafter per token (forward + probabilities), target per 1..max_l+1 tokens."""
    d_lm, t_lm = CachedLM(drafter.model, drafter.device), CachedLM(target.model, target.device)
    ctx = list(range(2000, 2000 + CONTEXT_TOKENS))
    d_lm.forward(ctx, 1)
    t_lm.forward(ctx, 1)
    times = {"draft": []} | {n: [] for n in range(1, max_l + 2)}
    for _ in range(TIMING_REPS):  # interleaved, so that load from other processes hits all alike
        times["draft"].append(_median_forward(d_lm, 1, 1.0))
        for n in range(1, max_l + 2):
            times[n].append(_median_forward(t_lm, n, 1.0))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"t_draft": med["draft"], "t_target": med[1], "t_forward": {n: med[n] for n in range(1, max_l + 2)}}


def oracle_table(alpha: float, costs: dict) -> dict[int, float]:
    """Predicted speedup per L: N(alpha, L) T_target / (L T_draft + T_forward(L + 1)), loopback comm ~0."""
    return {L: expected_tokens_per_call(alpha, L) * costs["t_target"] /
            oracle_time(L, costs["t_draft"], 0.0, costs["t_forward"][L + 1]) for L in DRAFT_LENS}


def full_vocab_targets(e: dict, r: dict) -> dict:
    """Held-out teacher data in full-vocabulary ids, for measuring the loaded (full-logit) drafter."""
    e["top_full"] = r["top_ids"][:, 0].long()
    e["ids_full"] = r["top_ids"].long()
    e["p_full"] = r["top_logp"].float().exp()
    return e


def main() -> int:
    p = argparse.ArgumentParser(description="build the default drafter")
    p.add_argument("--data", type=Path, default=DATA, help="where the teacher data is written / read")
    p.add_argument("--reuse-data", action="store_true", help="reuse --data if present instead of regenerating")
    p.add_argument("--num-prompts", type=int, default=GenConfig.num_prompts)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--layers", default=",".join(map(str, TrainConfig.init_layers)),
                   help="target layers the student's layers start from, e.g. 0,1")
    p.add_argument("--head-size", type=int, default=TrainConfig.head_size)
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    a = p.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    gen_cfg = GenConfig(num_prompts=a.num_prompts)
    if a.reuse_data and a.data.is_file():
        records = torch.load(a.data)
        print(f"[data] reusing {a.data} ({len(records)} answers)")
    else:
        exclude = {r["prompt"] for r in load_bench_prompts(ROOT / "bench" / "prompts.jsonl")}
        records = generate_dataset(gen_cfg, training_prompts(gen_cfg.num_prompts, gen_cfg.seed, exclude), a.data)
    cfg = replace(TrainConfig(), steps=a.steps, head_size=a.head_size,
                  init_layers=tuple(int(x) for x in a.layers.split(",")))
    student, keep, train_measures = train(cfg, records)
    meta = {"name": f"distilled-{len(cfg.init_layers)}L-{cfg.head_size}v", "int8": True,
            "train": asdict(cfg), "data": {**asdict(gen_cfg), "answers": len(records),
                                            "tokens": sum(len(r["gen"]) for r in records)}}
    save_drafter(a.out, student.layers, student.norm, student.head.weight, keep, meta)

    drafter = load_model(default_drafter_spec(path=a.out))
    target = load_model(ModelSpec())
    _, held = split(records)
    to_head = torch.full((drafter.vocab_size,), -1, dtype=torch.long)
    to_head[keep] = torch.arange(keep.numel())
    held_ex = [full_vocab_targets(make_true_p(make_example(r, to_head), r, to_head), r) for r in held]
    acc = heldout_acceptance(drafter, held_ex)
    costs = measure_costs(drafter, target, max(DRAFT_LENS))
    table = {t: oracle_table(acc[f"alpha_t{t}"], costs) for t in (0, 1)}
    best = max(DRAFT_LENS, key=lambda L: table[0][L])
    meta["measured"] = {
        "heldout_alpha_t0": acc["alpha_t0"], "heldout_alpha_t1": acc["alpha_t1"],
        "t_draft_ms": costs["t_draft"] * 1e3, "t_target_ms": costs["t_target"] * 1e3,
        "cost_ratio_c": costs["t_draft"] / costs["t_target"],
        "t_forward_ms": {n: v * 1e3 for n, v in costs["t_forward"].items()},
        "oracle_speedup_t0": table[0], "oracle_speedup_t1": table[1], "best_draft_len_t0": best,
    }
    meta["draft_len"] = best
    (a.out / "delta.json").write_text(json.dumps({**json.loads((a.out / "delta.json").read_text()), **meta},
                                                 indent=2) + "\n")
    print(f"\ndrafter {drafter.name}: {sum(f.stat().st_size for f in a.out.glob('*.safetensors')) / 1e6:.1f} MB "
          f"at {a.out}")
    print(f"held-out acceptance: T=0 {acc['alpha_t0']:.3f}   T=1 {acc['alpha_t1']:.3f} (1 - TV over the top-K)")
    print(f"cost: T_draft {costs['t_draft'] * 1e3:.2f} ms, T_target {costs['t_target'] * 1e3:.2f} ms per token, "
          f"c = {costs['t_draft'] / costs['t_target']:.3f}")
    print("forward over n tokens / one token: " +
          " ".join(f"{n}:{costs['t_forward'][n] / costs['t_target']:.2f}" for n in costs["t_forward"]))
    print("oracle-predicted speedup by draft length L (T=0 / T=1):")
    for L in DRAFT_LENS:
        print(f"  L={L}: {table[0][L]:.2f} / {table[1][L]:.2f}" + ("   <- best at T=0" if L == best else ""))
    print(f"total {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
