"""Benchmark: verifying one batched forward's rounds, session by session against batch tensor work.

After a batched target forward the edge verifies every session's round. Per session (the edge's path
before edge/verify_batch.py) that is the target's law over the round's L + 1 rows
(``model_probs``), the decoded packets densified, and ``chain_verify`` / ``dssd_edge_verify`` /
``gumbel_verify`` in Python; batched it is ``verify_rounds`` over all rounds at once. Both start from
the same logits and decoded packets (the packets' decoding, the same in both, is not timed) and
include what each round draws from its streams (uniforms, the coupled bonus's noise, gumbel's noise);
the forward is not timed. Every cell checks that the two give the same verdicts.

Inputs: random logits shaped like a language model's (a handful of tokens hold most of the mass:
``HEAD_TOKENS`` boosted by ``HEAD_BOOST``), drafts sampled from a TSLT-like q (the target's logits
plus noise, top-``DRAFT_TOP_K``), so rounds both reject and accept all; each cell reports its
acceptance. The batched path's work follows the rows it reaches (rows past a rejection are never
computed), so its time depends on the acceptance; the per-session path's does not.

    .venv/bin/python -m specdec.bench.bench_verify [--vocabs 49152,128256] [--sessions 1,8,32]
        [--drafts 5] [--temperatures 0,1] [--modes chain,dssd,gumbel] [--repeats 5] [--device cpu]

Writes results/bench_verify.json (``--out``; the committed run: docs/bench/verify/) and prints a table; the goal line (issue 45:
32 sessions x 5 drafts >= 5x faster batched, chain rounds at T = 0 and 1) reads the chain cells.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.harness import plan as harness_plan
from specdec.common import verification as V
from specdec.common.distributions import SparseDist, densify, race_token_unchecked
from specdec.common.runtime import retain_freed_memory
from specdec.common.sampling import TargetLaw
from specdec.common.streams import Purpose, stream
from specdec.edge.noise_ahead import draw_ahead, kept
from specdec.edge.verify_batch import RoundKind, chain_round, dssd_round, gumbel_round, verify_rounds

HEAD_TOKENS = 8         # tokens that hold most of a row's mass, as a language model's next-token law
HEAD_BOOST = (10.0, 16.0)  # their logits' lift over the N(0, 2^2) rest: the rest holds ~4 % of the mass
DRAFT_NOISE = 0.5       # the drafter's logits: the target's plus N(0, DRAFT_NOISE^2): ~0.6-0.75 of drafts accepted
DRAFT_TOP_K = 64        # TSLT's support per draft position
DSSD_SAMPLES = 8        # DSSD's m (the protocol's default)
GOAL_SESSIONS, GOAL_SPEEDUP = 32, 5.0
DEFAULT_OUT = Path("results/bench_verify.json")


@dataclass
class Session:
    """One session's round: its target logits and what it drafted."""
    logits: torch.Tensor          # [L + 1, V] float32 on the device
    draft: torch.Tensor           # [L] int64
    rows: list[SparseDist]        # q_i, decoded
    seed: int
    position: int

    gumbel_draft: torch.Tensor | None = None  # [L] what a gumbel drafter drafts from the same q
    q_of_draft: torch.Tensor | None = None    # [L] float64 q_i(x_i): what a DSSD round sends


def make_sessions(n: int, drafts: int, vocab: int, temperature: float, device: str, seed: int,
                  draft_noise: float = DRAFT_NOISE) -> list[Session]:
    g = torch.Generator().manual_seed(seed)
    sessions = []
    for b in range(n):
        logits = torch.randn(drafts + 1, vocab, generator=g) * 2.0
        for row in logits:
            head = torch.randint(0, vocab, (HEAD_TOKENS,), generator=g)
            row[head] += torch.empty(HEAD_TOKENS).uniform_(*HEAD_BOOST, generator=g)
        rows, draft = [], []
        for row in logits[:drafts]:
            noisy = row + torch.randn(vocab, generator=g) * draft_noise
            q = torch.softmax(noisy.double() / max(temperature, 1.0), dim=-1)
            ids = torch.sort(torch.topk(q, DRAFT_TOP_K).indices).values
            probs = q[ids] / q[ids].sum()
            if temperature == 0:  # a greedy drafter: one-hot at its argmax
                ids, probs = ids[probs.argmax()].reshape(1), torch.ones(1, dtype=torch.float64)
            rows.append(SparseDist(ids=ids, probs=probs, vocab_size=vocab))
            draft.append(int(ids[torch.multinomial(probs, 1, generator=g)]))
        s = Session(logits.to(device), torch.tensor(draft), rows, seed * 1000 + b, 100 + b)
        noise = _noise(s, vocab, temperature)  # a gumbel drafter races q with each position's noise
        s.gumbel_draft = torch.tensor([int(race_token_unchecked(densify(sd), noise(i))) for i, sd in enumerate(rows)])
        s.q_of_draft = torch.tensor([float(densify(sd)[x]) for sd, x in zip(rows, draft)], dtype=torch.float64)
        sessions.append(s)
    return sessions


def _bonus(s: Session, vocab: int):
    position = s.position + s.draft.numel()
    return lambda: V.bonus_noise(s.seed, position, vocab)


def _noise(s: Session, vocab: int, temperature: float):
    if temperature == 0:  # the edge draws no noise at T = 0 (a one-hot law races to its argmax)
        return lambda i: torch.ones(vocab, dtype=torch.float64)
    return lambda i: V.token_noise(s.seed, s.position + i, vocab)


def per_session(sessions: list[Session], mode: RoundKind, law: TargetLaw) -> list[tuple]:
    """The edge's path before batching: each round's rows, packets and accept tests on their own."""
    out = []
    for s in sessions:
        vocab = s.logits.shape[1]
        p = law.probs(s.logits)
        ids = s.draft.to(p.device)
        if mode is RoundKind.GUMBEL:
            r = V.gumbel_verify(s.gumbel_draft.to(p.device), p, _noise(s, vocab, law.temperature))
            out.append((r.num_accepted, r.next_token))
            continue
        generator = stream(s.seed, Purpose.VERIFY, s.position)
        if mode is RoundKind.DSSD:  # the scalars as the wire brings them: no q to densify
            r = V.dssd_edge_verify(ids, s.q_of_draft.to(p.device), p, generator, DSSD_SAMPLES, _bonus(s, vocab))
            out.append((r.num_accepted, r.bonus_token, tuple(r.reject_samples.tolist())))
        else:
            q = torch.stack([densify(sd, p.device) for sd in s.rows])
            r = V.chain_verify(ids, q, p, generator, _bonus(s, vocab))
            out.append((r.num_accepted, r.next_token))
    return out


def build_rounds(sessions: list[Session], mode: RoundKind, law: TargetLaw) -> list:
    """Each session's round, its uniforms drawn."""
    rounds = []
    for s in sessions:
        vocab = s.logits.shape[1]
        generator = stream(s.seed, Purpose.VERIFY, s.position)
        if mode is RoundKind.GUMBEL:
            rounds.append(gumbel_round(s.gumbel_draft, law, _noise(s, vocab, law.temperature)))
        elif mode is RoundKind.DSSD:
            rounds.append(dssd_round(s.draft, s.q_of_draft, law, generator, DSSD_SAMPLES, _bonus(s, vocab)))
        else:
            rounds.append(chain_round(s.draft, s.rows, law, generator, _bonus(s, vocab)))
    return rounds


def verdicts(sessions: list[Session], mode: RoundKind, rounds: list) -> list[tuple]:
    outcomes = verify_rounds([s.logits for s in sessions], rounds)
    if mode is RoundKind.DSSD:
        return [(o.num_accepted, o.next_token, o.reject_samples) for o in outcomes]
    return [(o.num_accepted, o.next_token) for o in outcomes]


def batched(sessions: list[Session], mode: RoundKind, law: TargetLaw) -> list[tuple]:
    """The edge's path now: every round built (its uniforms drawn) and verified together."""
    return verdicts(sessions, mode, build_rounds(sessions, mode, law))


def noise_ahead(sessions: list[Session], mode: RoundKind, law: TargetLaw, repeats: int,
                sync) -> tuple[float, float, list[tuple]]:
    """A GPU edge's path (edge/noise_ahead.py): the rounds built and their noise drawn while the forward
    runs (timed apart: the sessions' threads' work, on cores a GPU forward leaves idle), then verified
    together. Median seconds of the verification and of the draws, and the verdicts."""
    verify_s, draw_s, result = [], [], None
    for _ in range(repeats + 1):  # the first is the warm-up
        rounds = [kept(r) for r in build_rounds(sessions, mode, law)]
        start = time.perf_counter()
        for r in rounds:
            draw_ahead(r, lambda: False)
        drawn = time.perf_counter()
        sync()
        result = verdicts(sessions, mode, rounds)
        sync()
        verify_s.append(time.perf_counter() - drawn)
        draw_s.append(drawn - start)
    return statistics.median(verify_s[1:]), statistics.median(draw_s[1:]), result


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    result = fn()  # warm-up, and the verdicts compared
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def measure(a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cells = []
    for vocab in a.vocabs:
        for temperature in a.temperatures:
            law = TargetLaw(temperature)
            sessions = make_sessions(max(a.sessions), a.drafts, vocab, temperature, a.device, a.seed, a.draft_noise)
            for mode in a.modes:
                for n in a.sessions:
                    group = sessions[:n]
                    old_s, old = timed(lambda: per_session(group, mode, law), a.repeats, sync)
                    new_s, new = timed(lambda: batched(group, mode, law), a.repeats, sync)
                    accepted = [r[0] for r in new]
                    cell = {"vocab": vocab, "temperature": temperature, "mode": mode.value, "sessions": n,
                            "drafts": a.drafts, "per_session_s": old_s, "batched_s": new_s,
                            "speedup": old_s / new_s, "same_verdicts": old == new,
                            "acceptance": sum(accepted) / (n * a.drafts),
                            "all_accepted": sum(k == a.drafts for k in accepted) / n}
                    line = ""
                    if a.noise_ahead and temperature > 0:
                        ahead_s, draw_s, ahead = noise_ahead(group, mode, law, a.repeats, sync)
                        cell.update(noise_ahead_verify_s=ahead_s, noise_ahead_draw_s=draw_s,
                                    same_verdicts=cell["same_verdicts"] and ahead == old)
                        line = f"; noise drawn ahead: verify {ahead_s * 1e3:7.2f} ms (draws {draw_s * 1e3:7.2f} ms)"
                    cells.append(cell)
                    print(f"V={vocab:6d} T={temperature:g} {mode.value:6s} N={n:2d}: per session "
                          f"{old_s * 1e3:8.2f} ms, batched {new_s * 1e3:7.2f} ms, {old_s / new_s:5.2f}x, "
                          f"acceptance {cell['acceptance']:.2f}, same verdicts {cell['same_verdicts']}{line}", flush=True)
    return {"settings": {k: (v if not isinstance(v, list) else [getattr(x, "value", x) for x in v])
                         for k, v in vars(a).items() if k != "out"},
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": harness_plan.machine_info(), "git": harness_plan.git_info(), "cells": cells,
            "goals": goals(cells)}


def goals(cells: list[dict]) -> list[dict]:
    """Issue 45: chain rounds of 32 sessions x 5 drafts >= 5x faster batched, at each V and T."""
    out = []
    for c in cells:
        if c["mode"] == RoundKind.CHAIN.value and c["sessions"] == GOAL_SESSIONS:
            out.append({"vocab": c["vocab"], "temperature": c["temperature"], "speedup": c["speedup"],
                        "goal": GOAL_SPEEDUP, "met": c["speedup"] >= GOAL_SPEEDUP and c["same_verdicts"]})
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabs", type=_ints, default=[49152, 128256])
    ap.add_argument("--sessions", type=_ints, default=[1, 8, 32])
    ap.add_argument("--drafts", type=int, default=5)
    ap.add_argument("--temperatures", type=lambda t: [float(x) for x in t.split(",")], default=[0.0, 1.0])
    ap.add_argument("--modes", type=lambda t: [RoundKind(x) for x in t.split(",")],
                    default=[RoundKind.CHAIN, RoundKind.DSSD, RoundKind.GUMBEL])
    ap.add_argument("--draft-noise", type=float, default=DRAFT_NOISE,
                    help="the drafter's distance from the target (0: q is the target's top-K, nearly every draft accepted)")
    ap.add_argument("--noise-ahead", action="store_true",
                    help="at T > 0 also time the verification with each round's noise drawn beforehand, as a "
                    "GPU edge's session threads draw it while the forward runs (edge/noise_ahead.py), and the draws")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (an edge process's share of the cores)")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if a.drafts < 1 or a.repeats < 1 or not a.sessions or min(a.sessions) < 1 or min(a.vocabs) < DRAFT_TOP_K:
        ap.error(f"--drafts, --repeats and --sessions must be >= 1 and every vocabulary >= {DRAFT_TOP_K}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    retain_freed_memory()  # as edge-server does: both paths reuse freed memory instead of faulting it in
    result = measure(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for g in result["goals"]:
        print(f"goal: V={g['vocab']} T={g['temperature']:g} chain 32 x {a.drafts}: {g['speedup']:.2f}x "
              f"(>= {g['goal']:g}x) {'PASS' if g['met'] else 'MISS'}")
    print(f"wrote {a.out}")
    return 0 if all(c["same_verdicts"] for c in result["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
