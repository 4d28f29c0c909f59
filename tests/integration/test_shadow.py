"""Mode auto's shadow acceptance at T = 0: while an edge-only round streams, the drafter reads the tokens in
batched forwards (edge_only.catch_up) and notes, for each, whether its greedy choice was the token
that followed. Checked against the drafter's own forward over the whole sequence (no cache), and end to end:
shadowed edge-only rounds between drafted ones leave the drafter's cache as drafting expects it (the
session is still the target's greedy decode)."""
from __future__ import annotations

import torch

from specdec.common.modeling import encode_prompt
from specdec.common.settings import resolve as resolve_settings
from specdec.device.draft_model import DraftModel
from specdec.device.parts import Planner
from specdec.device.rounds import RoundPlan
from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy
from tests.support.parts import with_parts

PROMPT = "w1 w2 w3"
MAX_NEW = 40


def greedy_agreement(drafter, seq: list[int]) -> list[int]:
    """1 where the drafter's argmax after seq[:j] is seq[j], for j = 1 .. len(seq) - 1 (one forward, no cache)."""
    with torch.inference_mode():
        logits = drafter.model(torch.tensor([seq])).logits[0]
    return [int(int(logits[j - 1].argmax()) == seq[j]) for j in range(1, len(seq))]


def test_the_agreement_of_a_batched_feed_is_the_drafters_greedy_choice_at_each_position(accepting_pair_v512) -> None:
    target, drafter = load(str(accepting_pair_v512[0])), load(str(accepting_pair_v512[1]))
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    seq = prompt + target_greedy(accepting_pair_v512[0], prompt, MAX_NEW)  # a text the drafter half agrees with
    expected = greedy_agreement(drafter, seq)
    model = DraftModel(drafter, temperature=0.0)
    model.shaping.prompt_len = len(prompt)
    assert model.feed_agreement(seq, len(prompt) - 1) == []  # rows that predict the prompt's tokens: none
    model.feed(seq[:len(prompt)])                       # the prompt read
    got = model.feed_agreement(seq, len(prompt) + 9)    # 9 tokens in one forward ...
    got += model.feed_agreement(seq, len(seq) - 1)      # ... then the rest but the last (its successor unknown)
    assert model.lm.cache_len == len(seq) - 1
    assert got == expected[len(prompt):], (got, expected[len(prompt):])
    assert 0 < sum(got) < len(got)  # both outcomes occur: a shifted or inverted comparison is seen


class ShadowEveryOther(Planner):
    """Edge-only rounds of 12 tokens that shadow, and TSLT rounds of 3 drafts, by turns."""

    def plan(self, hello, vocab_size, round_id):
        if round_id % 2 == 0:
            return RoundPlan(resolve_settings(dict(mode="none", edge_tokens=12), vocab_size=vocab_size),
                             choice={"shadow": True})
        return RoundPlan(resolve_settings(dict(mode="tslt", top_k=16, draft_len=3), vocab_size=vocab_size))


def test_shadowed_edge_only_rounds_between_drafted_ones_keep_the_greedy_decode(accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    drafter = load(str(drafter_dir))
    records = []

    def session_factory(d, hello, **kw):
        session = with_parts(planner=ShadowEveryOther())(d, hello, **kw)
        session.listeners.append(lambda event: records.append(event.record))
        return session

    async def main():
        async with edge(target_dir) as address:
            cfg = device_config(mode="tslt", top_k=16, temperature=0.0, max_new_tokens=MAX_NEW, draft_ahead=False)
            return await run_sessions(address, drafter, cfg, PROMPT, [0], session_factory)

    [(tokens, _, session)] = run(main())
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    assert tokens == target_greedy(target_dir, prompt, MAX_NEW)
    shadows = [r.shadow for r in records if r.mode == "none"]
    assert any(shadows) and not any(r.shadow for r in records if r.mode != "none")
    # each shadow is the drafter's agreement over a stretch of the generated text (the first round, which
    # read the prompt too, none over the prompt's: at most a token each, the last left for the next read)
    assert all(len(r.shadow) <= r.generated for r in records), [(len(r.shadow), r.generated) for r in records]
    truth = "".join(map(str, greedy_agreement(drafter, prompt + tokens)[len(prompt) - 1:]))
    assert all("".join(map(str, s)) in truth for s in shadows if s), (shadows, truth)
    # the shadow's cost is counted where it ran (mode auto weighs it): the tokens its forwards read (the
    # first round's, the prompt's too) and their seconds
    fed = [(r.shadow_fed, r.shadow_s, len(r.shadow)) for r in records if r.mode == "none"]
    assert all((n >= k and (s > 0) == (n > 0)) for n, s, k in fed) and fed[0][0] >= len(prompt), fed
    assert not any(r.shadow_fed or r.shadow_s for r in records if r.mode != "none")
