"""Teacher data for the drafter: the target's own answers to templated prompts, with its top-K
log-probabilities at every generated position (the soft labels of the KL distillation).

Batched generation (left-padded, one KV cache for the batch) is several times cheaper per token than
decoding one sequence, and the teacher's distribution at each step comes for free with the token it
generates. Half of the batches decode greedily (the contexts the drafter sees at temperature 0),
half sample at temperature 1 (the contexts at temperature 1).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import math

import torch

from specdec.common.modeling import ModelSpec, encode_prompt, load_model

TOPK = 64             # teacher log-probs kept per position; the tail beyond is < 1% of mass on average
PAD_ID = 0            # any id: padded positions are masked out of attention and never recorded
HELDOUT_EVERY = 8     # every 8th prompt's answer is held out (12.5%) for the acceptance measures


@dataclass(frozen=True)
class GenConfig:
    num_prompts: int = 384       # ~43k generated tokens: 6 batches, ~8 min of an idle core
    batch_size: int = 64         # sequences decoded together (throughput grows with it until ~64)
    max_new_tokens: int = 128    # the benchmark's answer length
    greedy_every: int = 2        # every n-th batch greedy, the others sampled at temperature 1
    seed: int = 0


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new: int, greedy: bool, eos: set[int],
                   generator: torch.Generator) -> list[dict]:
    """Decode a batch; return per sequence its prompt, generated ids and teacher top-K log-probs."""
    from transformers import DynamicCache

    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)                      # [b, width]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    gen = [[] for _ in range(b)]
    top_ids = [[] for _ in range(b)]
    top_lp = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    last_pos = positions[:, -1]
    for _ in range(max_new):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)      # [b, V]
        vals, idx = logp.topk(TOPK, dim=-1)                             # [b, K]
        if greedy:
            nxt = logp.argmax(-1)
        else:
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
        for i in range(b):
            if not done[i]:
                gen[i].append(int(nxt[i]))
                top_ids[i].append(idx[i].to(torch.int32))
                top_lp[i].append(vals[i].half())
                if int(nxt[i]) in eos:
                    done[i] = True
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    past_key_values=out.past_key_values, use_cache=True)
    return [{"prompt": prompts[i], "gen": gen[i], "top_ids": torch.stack(top_ids[i]),
             "top_logp": torch.stack(top_lp[i]), "greedy": greedy} for i in range(b)]


def generate_dataset(cfg: GenConfig, prompts: list[str], out_path: Path, log=print) -> list[dict]:
    torch.manual_seed(cfg.seed)
    target = load_model(ModelSpec())
    tok = target.tokenizer
    eos = set(target.eos_token_ids)
    encoded = [encode_prompt(tok, p, raw=False) for p in prompts[:cfg.num_prompts]]
    generator = torch.Generator().manual_seed(cfg.seed)
    records: list[dict] = []
    t0 = time.perf_counter()
    n_tokens = 0
    batches = [encoded[i:i + cfg.batch_size] for i in range(0, len(encoded), cfg.batch_size)]
    for k, batch in enumerate(batches):
        greedy = k % cfg.greedy_every == 0
        recs = generate_batch(target.model, batch, cfg.max_new_tokens, greedy, eos, generator)
        records.extend(recs)
        n_tokens += sum(len(r["gen"]) for r in recs)
        dt = time.perf_counter() - t0
        log(f"[gen] batch {k + 1}/{len(batches)} ({'greedy' if greedy else 'T=1'}): "
            f"{n_tokens} tokens, {dt:.0f} s, {n_tokens / dt:.0f} tok/s")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(records, out_path)
    return records


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held-out) by prompt index: the held-out answers come from unseen prompts."""
    train = [r for i, r in enumerate(records) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held = [r for i, r in enumerate(records) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, held


def choose_head(records: list[dict], head_size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``head_size`` token ids with most teacher probability mass (+ ``always``), sorted. [N]"""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        mass.index_add_(0, r["top_ids"].long().flatten(), r["top_logp"].double().exp().flatten())
    mass[list(always)] = math.inf
    return mass.topk(head_size).indices.sort().values


def coverage(records: list[dict], keep: torch.Tensor, vocab_size: int) -> float:
    """Fraction of the teacher's top-1 tokens inside the head (an upper bound on alpha_t0)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[keep] = True
    top1 = torch.cat([r["top_ids"][:, 0].long() for r in records])
    return float(inside[top1].float().mean())


def main() -> None:
    from specdec.drafter_build.train_prompts import load_bench_prompts, training_prompts

    p = argparse.ArgumentParser(description="generate the drafter's teacher data with the target")
    p.add_argument("--num-prompts", type=int, default=GenConfig.num_prompts)
    p.add_argument("--batch-size", type=int, default=GenConfig.batch_size)
    p.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=GenConfig.seed)
    p.add_argument("--out", type=Path, default=Path("build/drafter/data.pt"))
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = GenConfig(num_prompts=a.num_prompts, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                    seed=a.seed)
    root = Path(__file__).resolve().parent.parent
    exclude = {r["prompt"] for r in load_bench_prompts(root / "bench" / "prompts.jsonl")}
    generate_dataset(cfg, training_prompts(cfg.num_prompts, cfg.seed, exclude), a.out)


if __name__ == "__main__":
    main()
