"""Where the default drafter's time per drafted token goes (issue 20), one torch thread.

Runs the device's own code on one prompt: ``CachedLM.forward`` of one token (what a draft step
feeds the drafter), then ``DraftSession``'s q (``model_probs``), TSLT encode + decode and sampling at
the recorded operating point. Reports:
  * ms per draft step: the forward, and q + encode + sample (median over ``--tokens`` steps);
  * the forward's time split by what runs (torch profiler, self CPU time per operator, grouped):
    int4 matmuls of the decoder layers, the LM head, attention, the KV-cache update, norms, rotary,
    the full-vocabulary logits, dtype conversions, other ops, and Python / dispatch overhead (the
    forward's wall time that no operator accounts for).

The profiler inflates small operators: it charges ``aten::cat`` (the KV-cache update) 1-9 ms per
token, which a cache written in place did not save in wall time (git history: the KVBuffer
experiment). Trust the unprofiled medians and the interleaved comparisons over the group split.

    .venv/bin/python -m specdec.bench.profile_drafter [--tokens 64] [--temperature 1] [--compare-heads N]
        [--contexts 3,50,150,300] [--out FILE]

``--contexts``: the one-token forward's median at each context length (mode auto times the drafter
from wherever its cache stands, device/edge_only.py ``time_drafter``) and what reading the longest
context at once (a prefill) takes.

Writes results/profile_drafter.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specdec.bench.harness.plan import RESULTS

PROMPT = "Write a short story about a robot learning to paint."
WARMUP_STEPS = 8
# operator name -> group; first match wins, unmatched operators count as "other ops"
GROUPS = (
    ("int4 matmuls (decoder layers)", ("_weight_int4pack_mm",)),
    ("LM head (reduced)", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("attention (sdpa)", ("scaled_dot_product", "_scaled_dot_product", "aten::_softmax", "aten::bmm", "flash")),
    ("KV cache update", ("aten::cat",)),
    ("rms norm", ("rms_norm", "aten::pow", "aten::rsqrt", "aten::mean")),
    ("rotary (cos/sin, roll)", ("aten::roll", "aten::cos", "aten::sin")),
    ("full-vocab logits (new_full + index_copy)", ("index_copy", "aten::fill_", "aten::new_full", "aten::full")),
    ("dtype conversions", ("aten::to", "aten::_to_copy", "aten::copy_")),
)


def _group(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other ops"


def _time_steps(lm, first: int, steps: int) -> tuple[list[float], list[int]]:
    """Greedy decode ``steps`` tokens one forward each: (seconds per forward, tokens)."""
    times, tokens, token = [], [], first
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = lm.forward([token], num_logits=1)
        times.append(time.perf_counter() - t0)
        token = int(logits[-1].argmax())
        tokens.append(token)
    return times, tokens


def profile_forward(lm, first: int, steps: int) -> dict[str, float]:
    """Self CPU ms per forward by group, plus the forward's wall time no operator accounts for."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        _time_steps(lm, first, steps)
        wall = time.perf_counter() - t0
    groups: dict[str, float] = {}
    for ev in prof.key_averages():
        groups[_group(ev.key)] = groups.get(_group(ev.key), 0.0) + ev.self_cpu_time_total / 1e3
    per_step = {g: ms / steps for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])}
    per_step["python / dispatch overhead (wall - ops)"] = max(0.0, wall * 1e3 / steps - sum(per_step.values()))
    return per_step


def time_sampling(session, lm, tokens: list[int], temperature: float) -> list[float]:
    """Seconds per draft step spent after the forward: q, encode + decode, sample."""
    from specdec.common.sampling import model_probs

    out = []
    generator = torch.Generator().manual_seed(0)
    for token in tokens:
        logits = lm.forward([token], num_logits=1)[0]
        t0 = time.perf_counter()
        encoded = session.drafting.encode(model_probs(logits.cpu(), temperature), session.hello.draft)
        session.parts.sampler.sample(encoded, generator, 0)
        out.append(time.perf_counter() - t0)
    return out


def compare_heads(drafter, prompt: list[int], tokens: int, repeats: int) -> dict[str, list[float]]:
    """Median ms per forward over ``tokens`` greedy steps after the prompt with the drafter's head
    and with a float32 copy of it (the previous default), interleaved (A B A B) ``repeats`` times."""
    from specdec.common.modeling import CachedLM
    from specdec.device.lean_drafter import HalfHead

    model = drafter.model
    built = model.head
    heads = {type(built).__name__: built}
    if isinstance(built, HalfHead):
        f32 = torch.nn.Linear(built.weight.shape[1], built.out_features, bias=False, device="meta")
        f32.weight = torch.nn.Parameter(built.weight.float(), requires_grad=False)
        heads["float32 Linear"] = f32
    out: dict[str, list[float]] = {name: [] for name in heads}
    try:
        for _ in range(repeats):
            for name, head in heads.items():
                model.head = head
                lm = CachedLM(model, drafter.device)
                first = int(lm.forward(prompt, num_logits=1)[-1].argmax())
                out[name].append(1e3 * statistics.median(_time_steps(lm, first, tokens)[0]))
    finally:
        model.head = built
    return out


def time_contexts(drafter, contexts: list[int], tokens: int) -> dict:
    """Median ms of a one-token forward after each context length (tokens of the bench prompts, repeated),
    and ms of one forward that reads the longest context at once."""
    from specdec.common.modeling import CachedLM, encode_prompt

    text = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    ids = (text * ((max(contexts) + tokens) // len(text) + 2))[:max(contexts) + tokens + 1]
    out: dict = {"forward_ms_median_by_context": {}}
    for n in contexts:
        lm = CachedLM(drafter.model, drafter.device)
        lm.forward(ids[:n], num_logits=1)
        times = []
        for i in range(tokens):
            t0 = time.perf_counter()
            lm.forward([ids[n + i]], num_logits=1)
            times.append(time.perf_counter() - t0)
        out["forward_ms_median_by_context"][str(n)] = 1e3 * statistics.median(times)
    lm = CachedLM(drafter.model, drafter.device)
    t0 = time.perf_counter()
    lm.forward(ids[:max(contexts)], num_logits=1)
    out["prefill_ms"] = {str(max(contexts)): 1e3 * (time.perf_counter() - t0)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--compare-heads", type=int, default=0, metavar="REPEATS",
                    help="also time the forward with the drafter's head and a float32 copy, interleaved REPEATS times")
    ap.add_argument("--contexts", default="", metavar="N,N,...",
                    help="also time a one-token forward after each context length, and a prefill of the longest")
    ap.add_argument("--out", default=str(RESULTS / "profile_drafter.json"))
    args = ap.parse_args()
    try:
        contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
        if any(n < 1 for n in contexts):
            raise ValueError(args.contexts)
    except ValueError:
        ap.error(f"--contexts: comma-separated positive integers, got {args.contexts!r}")
    torch.set_num_threads(1)
    from specdec.common.modeling import CachedLM, encode_prompt, load_model
    from specdec.device.session import DraftSession
    from specdec.device.factory import DeviceConfig, choose_drafter

    cfg = DeviceConfig(temperature=args.temperature)
    choice = choose_drafter(cfg)
    drafter = load_model(choice.spec)
    session = DraftSession(drafter, cfg.hello("fp", drafter.vocab_size, seed=0, operating_point=choice.operating_point))
    lm = CachedLM(drafter.model, drafter.device)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=False)
    first = int(lm.forward(prompt, num_logits=1)[-1].argmax())
    _, warm = _time_steps(lm, first, WARMUP_STEPS)
    forward_s, tokens = _time_steps(lm, warm[-1], args.tokens)
    groups = profile_forward(lm, tokens[-1], args.tokens)
    lm.truncate(len(prompt) + WARMUP_STEPS)
    sample_s = time_sampling(session, lm, tokens, args.temperature)
    result = {
        "drafter": drafter.name, "temperature": args.temperature, "tokens": args.tokens,
        "top_k": session.hello.draft.top_k, "mode": session.hello.draft.mode.value,
        "forward_ms_median": 1e3 * statistics.median(forward_s),
        "q_encode_sample_ms_median": 1e3 * statistics.median(sample_s),
        "forward_ms_by_group_profiled": groups,
        "load_average": os.getloadavg(), "torch": torch.__version__,
    }
    if contexts:
        result.update(time_contexts(drafter, contexts, args.tokens))
    if args.compare_heads:
        result["forward_ms_by_head"] = compare_heads(drafter, prompt, args.tokens, args.compare_heads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{drafter.name}: forward {result['forward_ms_median']:.2f} ms/token, q + {result['mode']} encode/decode "
          f"+ sample {result['q_encode_sample_ms_median']:.2f} ms/token (T = {args.temperature}, K = {result['top_k']})")
    print("forward under the profiler, ms per token (self CPU time):")
    for g, ms in groups.items():
        print(f"  {g:<45} {ms:6.2f}")
    for name, runs in result.get("forward_ms_by_head", {}).items():
        print(f"  forward with head {name:<15} median of {len(runs)} runs: {statistics.median(runs):.2f} ms/token "
              f"({', '.join(f'{r:.1f}' for r in runs)})")
    for n, ms in result.get("forward_ms_median_by_context", {}).items():
        print(f"  one-token forward after {n:>5} tokens of context: {ms:6.2f} ms")
    for n, ms in result.get("prefill_ms", {}).items():
        print(f"  reading {n} tokens at once (a prefill): {ms:.0f} ms")
    print(f"wrote {args.out}  (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
