"""Benchmark: what the target law's grammar costs and gives, on the embedded pair (issue 43's goals).

On texts the embedded target samples under a JSON schema (its law: temperature, the grammar's masks),
at every generated position:

- acceptance, exactly (sum_x min(p, q), no sampling noise): the drafter's q masked by the same grammar
  (as the device drafts) against its q unmasked;
- the grammar's cost on the edge: its masks for a chain round of ``--draft-len`` drafts (the rows the
  edge verifies) against that round's verify work without them (the target's cached forward over the
  drafts and the law's rows), on the same prefixes;
- the downlink bytes of logprobs per emitted token and per top-N entry (the verdict's wire size);
- validity: ``--samples`` answers sampled under the law (what the system's output is distributed as:
  the law tests check that device and edge sample it), each checked with ``jsonschema``.

    .venv/bin/python -m specdec.bench.bench_law [--temperature 1] [--prompts 4] [--max-new-tokens 64] [--draft-len 8]
                                                [--samples 200]

Writes results/bench_law_T<temperature>.json (``--out``) and prints a summary.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from specdec.bench.bench_truncation import _args, acceptance, load_pair_and_prompts, run
from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.adjust import chain_paths
from specdec.common.grammar import Grammar, GrammarKind, GrammarState
from specdec.common.logprobs import token_logprobs
from specdec.common.modeling import CachedLM, encode_prompt
from specdec.common.sampling import TargetLaw, model_probs
from specdec.device.draft_model import DraftModel

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                          "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
GRAMMAR = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
INSTRUCTION = "Answer with a JSON object describing a person (name, age, city, tags). "
TOP_NS = (0, 5, 20)


def _sample(target, state: GrammarState, ids: list[int], law: TargetLaw, max_new: int, g: torch.Generator) -> list[int]:
    """The target's own tokens under the law, one cached forward a token."""
    lm, out = CachedLM(target.model, target.device), []
    logits = lm.forward(ids, num_logits=1)
    for _ in range(max_new):
        row = law.shaped(logits, None, [[]], state.masks(out, [[]]))
        token = int(torch.multinomial(law.probs(row)[0], 1, generator=g))
        out.append(token)
        if token in target.eos_token_ids:
            break
        logits = lm.forward([token], num_logits=1)
    return out


def _positions(target, drafter, ids: list[int], out: list[int], state: GrammarState, law: TargetLaw):
    """(p, q masked, q unmasked) [V] each, at every generated position of ``ids + out``."""
    with torch.no_grad():
        p_logits = target.model(torch.tensor([ids + out])).logits[0]
    draft = DraftModel(drafter, law.temperature)
    for i in range(len(out)):
        at = len(ids) + i - 1
        mask = state.masks(out[:i], [[]])
        p = law.probs(law.shaped(p_logits[at:at + 1], None, [[]], mask))[0]
        q_row = draft.feed(ids + out[:i])[None]
        q_masked = model_probs(law.shaped(q_row, None, [[]], mask), law.temperature)[0]
        yield p, q_masked, model_probs(q_row, law.temperature)[0]


def _round_costs(target, ids: list[int], out: list[int], state: GrammarState, law: TargetLaw, draft_len: int):
    """(seconds of the grammar's masks, seconds of the round's forward + law rows), per chain round
    whose drafts are the text's next ``draft_len`` tokens."""
    lm, costs = CachedLM(target.model, target.device), []
    for start in range(0, len(out) - draft_len, draft_len):
        drafts = out[start:start + draft_len]
        lm.truncate(0)
        lm.forward((ids + out[:start])[:-1], num_logits=0)
        t0 = time.perf_counter()
        masks = state.masks(out[:start], chain_paths(drafts))
        t1 = time.perf_counter()
        with torch.no_grad():
            rows = lm.forward((ids + out[:start])[-1:] + drafts, num_logits=draft_len + 1)
        law.probs(law.shaped(rows, None, chain_paths(drafts), masks))
        costs.append((t1 - t0, time.perf_counter() - t1))
    return costs


def _logprob_bytes(probs: torch.Tensor, tokens: list[int]) -> dict:  # probs: [n, V] the law at each token
    """Verdict bytes of logprobs for the sampled texts' own tokens and rows, as the edge sends them (8
    tokens a verdict): per token for their own, per top-N entry for the top."""
    def size(n: int) -> int:
        total = 0
        for k in range(0, len(tokens) - 7, 8):
            lps = token_logprobs(probs[k:k + 8], tokens[k:k + 8], n, compact=True) if n >= 0 else ()
            total += wire.verdict_to_pb(P.Verdict(1, 7, tokens[k + 7], logprobs=lps)).ByteSize()
        return total
    count = len(tokens) // 8 * 8
    return {"tokens": count, "own_per_token": (size(0) - size(-1)) / count,
            **{f"top{n}_per_entry": (size(n) - size(0)) / (count * n) for n in TOP_NS if n}}


def _validity(target, law: TargetLaw, samples: int, max_new: int, g: torch.Generator) -> dict:
    """Of ``samples`` answers to one prompt under the law: finished (EOS within ``max_new``) and, of
    those, valid under SCHEMA."""
    import jsonschema
    ids = encode_prompt(target.tokenizer, INSTRUCTION, raw=False)
    finished = valid = 0
    for _ in range(samples):
        state = GrammarState(GRAMMAR, target.tokenizer, target.vocab_size, target.eos_token_ids)
        out = _sample(target, state, ids, law, max_new, g)
        if out and out[-1] in target.eos_token_ids:
            finished += 1
            try:
                jsonschema.validate(json.loads(target.tokenizer.decode(out, skip_special_tokens=True)), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"samples": samples, "finished": finished, "valid_of_finished": valid}


def measure(a) -> dict:
    target, drafter, prompts = load_pair_and_prompts(a)
    law = TargetLaw(a.temperature)
    g = torch.Generator().manual_seed(a.seed)
    masked, unmasked, grammar_s, verify_s, texts, valid = [], [], [], [], [], 0
    rows, emitted = [], []  # the law's row at each sampled token, and the token: logprob bytes
    for text in prompts:
        ids = encode_prompt(target.tokenizer, INSTRUCTION + text, raw=False)
        state = GrammarState(GRAMMAR, target.tokenizer, target.vocab_size, target.eos_token_ids)
        out = _sample(target, state, ids, law, a.max_new_tokens, g)
        body = target.tokenizer.decode(out, skip_special_tokens=True)
        texts.append(body)
        try:
            json.loads(body)
            valid += 1
        except ValueError:
            pass
        for i, (p, q_m, q_u) in enumerate(_positions(target, drafter, ids, out, state, law)):
            masked.append(acceptance(p, q_m))
            unmasked.append(acceptance(p, q_u))
            rows.append(p.float())
            emitted.append(out[i])
        for gs, vs in _round_costs(target, ids, out, state, law, a.draft_len):
            grammar_s.append(gs)
            verify_s.append(vs)
    return {"positions": len(masked), "acceptance_masked": statistics.fmean(masked),
            "acceptance_unmasked": statistics.fmean(unmasked),
            "rounds": len(grammar_s), "draft_len": a.draft_len,
            "grammar_ms_per_round": 1e3 * statistics.median(grammar_s),
            "verify_ms_per_round": 1e3 * statistics.median(verify_s),
            "grammar_over_verify": statistics.median(grammar_s) / statistics.median(verify_s),
            "logprob_bytes": _logprob_bytes(torch.stack(rows).double(), emitted),
            "validity": _validity(target, law, a.samples, 4 * a.max_new_tokens, g) if a.samples else None,
            "texts_finished_valid": f"{valid}/{len(texts)}", "texts": texts}


def main(argv: list[str] | None = None) -> int:
    ap_argv = list(argv if argv is not None else sys.argv[1:])
    own = {"--draft-len": 8, "--samples": 200}  # this bench's flags beyond bench_truncation's
    for flag in own:
        if flag in ap_argv:
            k = ap_argv.index(flag)
            own[flag] = int(ap_argv[k + 1])
            del ap_argv[k:k + 2]
    a = _args(ap_argv, __doc__)
    a.draft_len, a.samples = own["--draft-len"], own["--samples"]
    res, out = run(a, measure, "bench_law")
    print(f"acceptance under the grammar: q masked {res['acceptance_masked']:.3f}, unmasked "
          f"{res['acceptance_unmasked']:.3f} ({res['positions']} positions)")
    print(f"grammar {res['grammar_ms_per_round']:.2f} ms / verify round {res['verify_ms_per_round']:.1f} ms at "
          f"L = {res['draft_len']}: {100 * res['grammar_over_verify']:.1f} %")
    print(f"logprob bytes: {res['logprob_bytes']}; finished valid JSON {res['texts_finished_valid']}")
    if res["validity"]:
        v = res["validity"]
        print(f"validity: {v['valid_of_finished']} valid of {v['finished']} finished, {v['samples']} samples")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
