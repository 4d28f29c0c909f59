"""Mode auto's shadow acceptance: while an edge-only round streams, the drafter reads the tokens in batched
forwards (edge_only.catch_up) and notes, for each, at T = 0 whether its greedy choice was the token that
followed, at T > 0 min(1, q(x)/p(x)) with p(x) from the edge (Draft.token_probs). Checked against the
drafter's (and the target's) own forward over the whole sequence (no cache), and end to end: shadowed
edge-only rounds between drafted ones leave the drafter's cache as drafting expects it (the session is
still the target's greedy decode; at T = 1, asking the edge for p changes no token)."""
from __future__ import annotations

import torch

from specdec.common.modeling import encode_prompt
from specdec.common.sampling import TargetLaw
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
    drafter = load(str(accepting_pair_v512[1]))
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
    """Edge-only rounds of 12 tokens (that shadow, unless ``shadow`` is off), and TSLT rounds of 3
    drafts, by turns."""

    def __init__(self, shadow: bool = True):
        self.shadow = shadow

    def plan(self, hello, vocab_size, round_id):
        if round_id % 2 == 0:
            return RoundPlan(resolve_settings(dict(mode="none", edge_tokens=12), vocab_size=vocab_size),
                             choice={"shadow": True} if self.shadow else None)
        return RoundPlan(resolve_settings(dict(mode="tslt", top_k=16, draft_len=3), vocab_size=vocab_size))


def shadowed_session(pair, temperature: float, seed: int, shadow: bool = True):
    """One session of :class:`ShadowEveryOther` rounds against a real edge: (tokens, session, round records)."""
    target_dir, drafter_dir = pair
    drafter = load(str(drafter_dir))
    records = []

    def session_factory(d, hello, **kw):
        session = with_parts(planner=ShadowEveryOther(shadow))(d, hello, **kw)
        session.listeners.append(lambda event: records.append(event.record))
        return session

    async def main():
        async with edge(target_dir) as address:
            cfg = device_config(mode="tslt", top_k=16, temperature=temperature, max_new_tokens=MAX_NEW,
                                draft_ahead=False)
            return await run_sessions(address, drafter, cfg, PROMPT, [seed], session_factory)

    [(tokens, _, session)] = run(main())
    return tokens, session, records


def test_shadowed_edge_only_rounds_between_drafted_ones_keep_the_greedy_decode(accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    drafter = load(str(drafter_dir))
    tokens, _, records = shadowed_session(accepting_pair_v512, 0.0, 0)
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


def full_probs(model, seq: list[int], temperature: float) -> torch.Tensor:  # [len(seq) - 1, V]
    """Row j - 1: the model's law at ``temperature`` after seq[:j] (one forward, no cache)."""
    with torch.inference_mode():
        logits = model.model(torch.tensor([seq])).logits[0, :-1]
    return TargetLaw(temperature).probs(logits)


def test_at_t1_the_shadow_is_min_1_q_over_p_of_each_streamed_token_and_changes_no_token(accepting_pair_v512) -> None:
    """Each value of a T = 1 shadow is min(1, q(x)/p(x)) of a generated token x, p the target's law
    there as the edge sent it and q the drafter's (both recomputed here without a cache: a shifted
    position, a swapped ratio or a p taken from the wrong row fails); the session that did not ask for
    logprobs gets none; and the same seed with rounds that ask for no p gives the same tokens."""
    target_dir, drafter_dir = accepting_pair_v512
    drafter = load(str(drafter_dir))
    tokens, session, records = shadowed_session(accepting_pair_v512, 1.0, 5)
    assert shadowed_session(accepting_pair_v512, 1.0, 5, shadow=False)[0] == tokens
    assert session.logprobs == []
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    seq = prompt + tokens
    p = full_probs(load(str(target_dir)), seq, 1.0)
    q = full_probs(drafter, seq, 1.0)
    x = torch.tensor(seq[1:])
    rows = torch.arange(len(x))
    truth = torch.clamp(q[rows, x] / p[rows, x], max=1.0).tolist()  # truth[j - 1]: the token at index j
    values = [v for r in records if r.mode == "none" for v in r.shadow]
    assert len(values) >= 12 and all(0.0 <= v <= 1.0 for v in values), values
    assert any(v < 0.99 for v in values) and any(v > 0.5 for v in values), values  # not all 1 (nor all tiny)
    # each shadow value matches the truth at some generated position, in order (a round's values are
    # consecutive positions of the text)
    generated = truth[len(prompt) - 1:]
    for r in records:
        if r.mode == "none" and r.shadow:
            starts = [i for i in range(len(generated) - len(r.shadow) + 1)
                      if all(abs(a - b) < 1e-3 for a, b in zip(r.shadow, generated[i:]))]
            assert starts, (r.shadow, generated)
