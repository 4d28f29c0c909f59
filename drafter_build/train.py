"""Distillation of a small drafter from the target's own answers: the direction that did NOT win.

Kept to reproduce the numbers in device/drafter_weights/README.md ("what was tried"): after 150
steps of 2048 labelled positions (4-7 min of one core) these students reach only ~0.30 acceptance
at T = 0 on held-out answers, below a trigram table built from the same data (0.36), far below the
quantized target that became the default drafter (int8 + SmoothQuant: 0.91; int4 on the target's own
Q4_1 codes: 0.98). Run: ``python -m specdec.drafter_build.train --data build/drafter/data.pt``.

Student: the target's token embeddings (frozen, shared at load time), ``len(init_layers)`` decoder
layers initialised from the target's layers ``init_layers``, the final norm, and a reduced head over
the ``head_size`` tokens with the most teacher probability mass, initialised from the tied
embedding rows. Loss: cross-entropy against the teacher's top-K distribution restricted to the head
and renormalised (= KL(p || q) on the head up to a constant), on generated positions only.

Held-out measures (prompts never trained on), exactly the quantities speculative decoding uses:
  * alpha_t0: argmax q == argmax p on the target's greedy answers (temperature-0 acceptance);
  * alpha_t1: sum_x min(p(x), q(x)) = 1 - TV(p, q) on its T=1 answers (expected acceptance at T=1),
    summed over the teacher's top-K (a lower bound: the tail beyond top-K is left out).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.drafter_build.gen_data import choose_head, coverage, split
from specdec.common.modeling import ModelSpec, load_model

@dataclass(frozen=True)
class TrainConfig:
    frozen_layers: int = 0                  # the target's first layers, kept as they are (features cached)
    init_layers: tuple[int, ...] = (0, 1)   # target layers the student's trainable layers start from
    head_size: int = 8192                   # reduced vocabulary: tokens with most teacher mass
    steps: int = 150                        # optimizer steps
    tokens_per_step: int = 2048             # labelled positions per step (whole sequences packed)
    lr: float = 1e-3                        # peak AdamW learning rate (cosine decay after warmup)
    warmup: int = 30                        # linear warmup steps
    seed: int = 0
    eval_every: int = 200                   # steps between held-out measures (0 = only at the end)


class Student(torch.nn.Module):
    """Frozen embeddings and first target layers + trainable layers, norm and reduced head."""

    def __init__(self, target, frozen: int, init_layers: tuple[int, ...], keep: torch.Tensor):
        super().__init__()
        import copy

        base = target.model                                   # LlamaModel
        self.embed = base.embed_tokens
        self.embed.weight.requires_grad_(False)
        self.frozen = torch.nn.ModuleList(list(base.layers[:frozen])).requires_grad_(False)
        self.layers = torch.nn.ModuleList([copy.deepcopy(base.layers[i]) for i in init_layers])
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = i
        self.norm = copy.deepcopy(base.norm)
        self.rotary = base.rotary_emb
        self.head = torch.nn.Linear(self.embed.weight.shape[1], keep.numel(), bias=False)
        self.head.weight.data.copy_(self.embed.weight.data[keep])
        self.register_buffer("keep", keep, persistent=False)

    @staticmethod
    def _run(layers, x: torch.Tensor, pad_mask: torch.Tensor, rotary) -> torch.Tensor:
        b, t = pad_mask.shape
        pos = torch.arange(t).unsqueeze(0).expand(b, t)
        cos_sin = rotary(x, pos)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = (causal[None] & pad_mask[:, None, :].bool())[:, None]          # [B, 1, T, T]
        for layer in layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x

    @torch.no_grad()
    def trunk(self, ids: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """The frozen part: embeddings + the target's first layers. [B, T] -> [B, T, H]."""
        return self._run(self.frozen, self.embed(ids), pad_mask, self.rotary)

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        """ids, pad_mask: [B, T] (right padded); rows, cols: [M] labelled positions -> [M, N] logits.

        ``feats`` [B, T, H]: the trunk's output, if cached. The head (a third of the student's
        compute) runs only where there is a label.
        """
        x = self.trunk(ids, pad_mask) if feats is None else feats
        x = self._run(self.layers, x, pad_mask, self.rotary)
        return self.head(self.norm(x[rows, cols]))


def make_example(r: dict, to_head: torch.Tensor) -> dict:
    """Token sequence, labelled positions and head-restricted teacher targets of one answer."""
    prompt, gen = r["prompt"], r["gen"]
    ids = torch.tensor(prompt + gen[:-1], dtype=torch.long)       # the last token predicts nothing
    n = len(gen)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)      # position i predicts gen[i - P + 1]
    hid = to_head[r["top_ids"].long()]                            # [n, K] head index or -1
    p = r["top_logp"].float().exp() * (hid >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return {"ids": ids, "pos": pos, "hid": hid.clamp_min(0), "p": p,
            "top1": hid[:, 0], "greedy": bool(r["greedy"])}


def collate(batch: list[dict]) -> dict:
    t = max(len(e["ids"]) for e in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    pad = torch.zeros(len(batch), t, dtype=torch.long)
    rows, cols = [], []
    for i, e in enumerate(batch):
        ids[i, :len(e["ids"])] = e["ids"]
        pad[i, :len(e["ids"])] = 1
        rows.append(torch.full_like(e["pos"], i))
        cols.append(e["pos"])
    out = {"ids": ids, "pad": pad, "rows": torch.cat(rows), "cols": torch.cat(cols),
           "hid": torch.cat([e["hid"] for e in batch]), "p": torch.cat([e["p"] for e in batch]),
           "top1": torch.cat([e["top1"] for e in batch]),
           "greedy": torch.cat([torch.full((len(e["pos"]),), e["greedy"]) for e in batch])}
    if all("feat" in e for e in batch):
        out["feats"] = torch.zeros(len(batch), t, batch[0]["feat"].shape[-1])
        for i, e in enumerate(batch):
            out["feats"][i, :len(e["ids"])] = e["feat"].float()
    if all("p_true" in e for e in batch):
        out["p_true"] = torch.cat([e["p_true"] for e in batch])
    return out


def chunks_of(examples: list[dict], tokens: int) -> list[list[dict]]:
    """Consecutive groups of whole answers, each closed once it holds >= ``tokens`` labelled positions."""
    chunks, cur, n = [], [], 0
    for e in examples:
        cur.append(e)
        n += len(e["pos"])
        if n >= tokens:
            chunks.append(cur)
            cur, n = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def batches(examples: list[dict], tokens_per_step: int, rng: random.Random):
    """Endless batches of whole answers, ~tokens_per_step labelled positions, similar lengths."""
    while True:
        order = sorted(examples, key=lambda e: len(e["ids"]) + rng.random() * 40)
        chunks = chunks_of(order, tokens_per_step)
        rng.shuffle(chunks)
        for c in chunks:
            yield collate(c)


def head_loss(logits: torch.Tensor, b: dict) -> torch.Tensor:
    """Soft cross-entropy against the head-restricted teacher top-K. logits: [M, N]."""
    lq = F.log_softmax(logits, dim=-1)                                 # [M, N]
    return -(b["p"] * lq.gather(-1, b["hid"])).sum(-1).mean()


@torch.no_grad()
def evaluate(student: Student, examples: list[dict], max_tokens: int = 2048) -> dict:
    """alpha_t0 (greedy answers), alpha_t1 (T=1 answers) and the loss, on held-out examples."""
    student.eval()
    hits = n0 = 0
    overlap = 0.0
    n1 = 0
    loss = 0.0
    for c in chunks_of(examples, max_tokens):
        b = collate(c)
        logits = student(b["ids"], b["pad"], b["rows"], b["cols"], b.get("feats"))     # [M, N]
        q = logits.softmax(-1)
        g = b["greedy"]
        top_ok = b["top1"] >= 0
        hits += int(((q.argmax(-1) == b["top1"]) & top_ok & g).sum())
        n0 += int(g.sum())
        # 1 - TV over the teacher's top-K: sum_x min(p, q) with p the teacher's own (raw) probability
        mins = torch.minimum(b["p_true"], q.gather(-1, b["hid"]))
        overlap += float(mins.sum(-1)[~g].sum())
        n1 += int((~g).sum())
        loss += float(-(b["p"] * q.clamp_min(1e-30).log().gather(-1, b["hid"])).sum())
    student.train()
    return {"alpha_t0": hits / max(n0, 1), "alpha_t1": overlap / max(n1, 1),
            "loss": loss / max(n0 + n1, 1)}


def train(cfg: TrainConfig, records: list[dict], log=print) -> tuple[Student, torch.Tensor, dict]:
    """Train a student on ``records``; returns it, its head ids and the final held-out measures."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    target = load_model(ModelSpec(num_layers=max(cfg.frozen_layers, *cfg.init_layers) + 1)).model
    vocab = int(target.config.vocab_size)
    train_recs, held_recs = split(records)
    eos = target.config.eos_token_id
    keep = choose_head(train_recs, cfg.head_size, vocab, tuple(eos if isinstance(eos, list) else [eos]))
    to_head = torch.full((vocab,), -1, dtype=torch.long)
    to_head[keep] = torch.arange(keep.numel())
    log(f"[train] head {keep.numel()} tokens: held-out top-1 coverage {coverage(held_recs, keep, vocab):.3f}")
    train_ex = [make_example(r, to_head) for r in train_recs]
    held_ex = [make_true_p(make_example(r, to_head), r, to_head) for r in held_recs]
    student = Student(target, cfg.frozen_layers, cfg.init_layers, keep)
    del target
    if cfg.frozen_layers:
        t_feat = time.perf_counter()
        cache_trunk(student, train_ex + held_ex)
        log(f"[train] trunk features of {cfg.frozen_layers} frozen layers cached in "
            f"{time.perf_counter() - t_feat:.0f} s")
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) *
                                              0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    log(f"[train] {len(train_ex)} answers ({sum(len(e['pos']) for e in train_ex)} positions), "
        f"{len(held_ex)} held out; before: {fmt(evaluate(student, held_ex))}")
    t0 = time.perf_counter()
    it = batches(train_ex, cfg.tokens_per_step, rng)
    running = None
    for step in range(1, cfg.steps + 1):
        b = next(it)
        loss = head_loss(student(b["ids"], b["pad"], b["rows"], b["cols"], b.get("feats")), b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0:
            log(f"[train] step {step}/{cfg.steps} loss {running:.3f} {time.perf_counter() - t0:.0f} s")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            log(f"[train] step {step}: {fmt(evaluate(student, held_ex))}")
    final = evaluate(student, held_ex)
    log(f"[train] done in {time.perf_counter() - t0:.0f} s: {fmt(final)}")
    return student, keep, final


def cache_trunk(student: Student, examples: list[dict], max_tokens: int = 4096) -> None:
    """Run the frozen trunk once per example (batched by length); keep its output as ``feat``."""
    order = sorted(examples, key=lambda e: len(e["ids"]))
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(order[j]["ids"]) <= max_tokens:
            j += 1
        j = max(j, i + 1)
        chunk = order[i:j]
        b = collate(chunk)
        feats = student.trunk(b["ids"], b["pad"])
        for k, e in enumerate(chunk):
            e["feat"] = feats[k, :len(e["ids"])].half()
        i = j


def make_true_p(e: dict, r: dict, to_head: torch.Tensor) -> dict:
    """Held-out examples keep the teacher's raw top-K probabilities (not renormalised to the head)."""
    hid = to_head[r["top_ids"].long()]
    e["p_true"] = r["top_logp"].float().exp() * (hid >= 0)
    return e


def fmt(m: dict) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in m.items())


def main() -> None:
    import argparse
    import sys
    from dataclasses import replace
    from pathlib import Path

    p = argparse.ArgumentParser(description="distil a small drafter and report its held-out acceptance")
    p.add_argument("--data", type=Path, default=Path("build/drafter/data.pt"))
    p.add_argument("--frozen", type=int, default=0, help="the target's first layers kept frozen")
    p.add_argument("--layers", default="0,1", help="target layers the trainable layers start from")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--head-size", type=int, default=TrainConfig.head_size)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = replace(TrainConfig(), frozen_layers=a.frozen, steps=a.steps, head_size=a.head_size, eval_every=25,
                  init_layers=tuple(int(x) for x in a.layers.split(",")))
    train(cfg, torch.load(a.data), log=lambda line: print(line, flush=True))
    sys.exit(0)


if __name__ == "__main__":
    main()
