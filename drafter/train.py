"""Distil the default drafter from the target's own answers (teacher data from gen_data.py).

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

from specdec.common.modeling import ModelSpec, load_model

HELDOUT_EVERY = 20        # every 20th prompt's answer is held out (5%) for the acceptance measures


@dataclass(frozen=True)
class TrainConfig:
    init_layers: tuple[int, ...] = (0, 1)   # target layers the student's layers start from
    head_size: int = 8192                   # reduced vocabulary: tokens with most teacher mass
    steps: int = 1200                       # optimizer steps
    tokens_per_step: int = 2048             # labelled positions per step (whole sequences packed)
    lr: float = 1e-3                        # peak AdamW learning rate (cosine decay after warmup)
    warmup: int = 30                        # linear warmup steps
    seed: int = 0
    eval_every: int = 200                   # steps between held-out measures (0 = only at the end)


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


class Student(torch.nn.Module):
    """Frozen embeddings + trainable layers, norm and reduced head (logits over the head only)."""

    def __init__(self, target, init_layers: tuple[int, ...], keep: torch.Tensor):
        super().__init__()
        import copy

        base = target.model                                   # LlamaModel
        self.embed = base.embed_tokens
        self.embed.weight.requires_grad_(False)
        self.layers = torch.nn.ModuleList([copy.deepcopy(base.layers[i]) for i in init_layers])
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = i
        self.norm = copy.deepcopy(base.norm)
        self.rotary = base.rotary_emb
        self.head = torch.nn.Linear(self.embed.weight.shape[1], keep.numel(), bias=False)
        self.head.weight.data.copy_(self.embed.weight.data[keep])
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, ids: torch.Tensor, pad_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor) -> torch.Tensor:
        """ids, pad_mask: [B, T] (right padded); rows, cols: [M] labelled positions -> [M, N] logits.

        The head (a third of the student's compute) runs only where there is a label.
        """
        b, t = ids.shape
        x = self.embed(ids)                                                   # [B, T, H]
        pos = torch.arange(t).unsqueeze(0).expand(b, t)
        cos_sin = self.rotary(x, pos)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = (causal[None] & pad_mask[:, None, :].bool())[:, None]          # [B, 1, T, T]
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
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
    if "p_true" in batch[0]:
        out["p_true"] = torch.cat([e["p_true"] for e in batch])
    return out


def batches(examples: list[dict], tokens_per_step: int, rng: random.Random):
    """Endless batches of whole answers, ~tokens_per_step labelled positions, similar lengths."""
    while True:
        order = sorted(examples, key=lambda e: len(e["ids"]) + rng.random() * 40)
        chunks, cur, n = [], [], 0
        for e in order:
            cur.append(e)
            n += len(e["pos"])
            if n >= tokens_per_step:
                chunks.append(cur)
                cur, n = [], 0
        if cur:
            chunks.append(cur)
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
    chunks, cur, n = [], [], 0
    for e in examples:
        cur.append(e)
        n += len(e["pos"])
        if n >= max_tokens:
            chunks.append(cur)
            cur, n = [], 0
    if cur:
        chunks.append(cur)
    for c in chunks:
        b = collate(c)
        logits = student(b["ids"], b["pad"], b["rows"], b["cols"])     # [M, N]
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
    target = load_model(ModelSpec(num_layers=max(cfg.init_layers) + 1)).model
    vocab = int(target.config.vocab_size)
    train_recs, held_recs = split(records)
    eos = target.config.eos_token_id
    keep = choose_head(train_recs, cfg.head_size, vocab, tuple(eos if isinstance(eos, list) else [eos]))
    to_head = torch.full((vocab,), -1, dtype=torch.long)
    to_head[keep] = torch.arange(keep.numel())
    log(f"[train] head {keep.numel()} tokens: held-out top-1 coverage {coverage(held_recs, keep, vocab):.3f}")
    train_ex = [make_example(r, to_head) for r in train_recs]
    held_ex = [make_true_p(make_example(r, to_head), r, to_head) for r in held_recs]
    student = Student(target, cfg.init_layers, keep)
    del target
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
        loss = head_loss(student(b["ids"], b["pad"], b["rows"], b["cols"]), b)
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


def make_true_p(e: dict, r: dict, to_head: torch.Tensor) -> dict:
    """Held-out examples keep the teacher's raw top-K probabilities (not renormalised to the head)."""
    hid = to_head[r["top_ids"].long()]
    e["p_true"] = r["top_logp"].float().exp() * (hid >= 0)
    return e


def fmt(m: dict) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in m.items())
