"""Statistical losslessness end to end: many seeded sessions over real gRPC vs the exact target law.

A tiny 8-token vocabulary lets us enumerate the target's exact distribution over the first
``N_TOKENS`` generated tokens (EOS ends a sequence early). Each mode must match it (chi-square,
merged cells, p > 1e-4); a device that samples from a different q than the one it sends must not.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from tests.support.harness import SwitchesEveryRound, device_config, load, load_spec, split_sessions
from specdec.common import verification
from specdec.common.settings import Mode
from specdec.common.distributions import filter_target_logits, sample_token
from specdec.common.sampling import model_probs
from specdec.common.modeling import ModelSpec, encode_prompt
from specdec.common.streams import Purpose, stream
from specdec.device import lean_drafter
from specdec.device.draft_model import DraftStep
from specdec.device.session import DraftSession
from specdec.edge import servicer
from specdec.edge.verifier import VerifierSession
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

PROMPT = "w1 w2"
N_TOKENS = 3
TEMPERATURE = 1.0
NUM_SESSIONS = 1500  # ~20-40 s per mode here; the control falls far below the cut at this size
CONTROL_SESSIONS = 600  # a control whose bias is large needs fewer sessions to be rejected
CONCURRENCY = 4  # sessions in flight: overlaps one session's network waits with another's compute

MODES = {
    "dense": dict(mode=Mode.DENSE, dense_dtype="bf16"),
    "tslt": dict(mode=Mode.TSLT, top_k=3),
    # chain modes draw the bonus token with the coupled noise by default; this one from the edge's stream
    "tslt uncoupled bonus": dict(mode=Mode.TSLT, top_k=3, coupled_bonus=False),
    "ksqs": dict(mode=Mode.KSQS, top_k=3, lattice=8),
    "csqs": dict(mode=Mode.CSQS, csqs_beta0=0.05, csqs_alpha=0.05, csqs_eta=0.05, lattice=8, max_k=8),
    # a fallback sends p_j's top-1 and (patched below) one tail sample: the head resolves some, the
    # rest run out and fetch the whole p_j, so both fallback replies cross the wire
    "dssd": dict(mode=Mode.DSSD, dssd_samples=1, dssd_fallback_top_k=1),
    "none": dict(mode=Mode.NONE),  # the edge alone, streaming: the baseline every link benchmark uses
}


@lru_cache(maxsize=4)
def exact_law(target_dir: str, prompt_ids: tuple[int, ...], temperature: float = TEMPERATURE, top_k: int = 0,
              top_p: float = 0.0) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS generated tokens = s) for the target alone, by enumeration (with the target's
    own temperature, top-k and top-p, as transformers samples it)."""
    m = load(target_dir)
    eos = set(m.eos_token_ids)
    law: dict[tuple[int, ...], float] = {}

    def visit(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == N_TOKENS or (seq and seq[-1] in eos):
            law[seq] = law.get(seq, 0.0) + prob
            return
        with torch.inference_mode():
            logits = m.model(torch.tensor([list(prompt_ids) + list(seq)])).logits[0, -1].float()
        p = model_probs(logits, temperature, top_k, top_p)
        for tok, pt in enumerate(p.tolist()):
            if pt > 0:
                visit(seq + (tok,), prob * pt)

    visit((), 1.0)
    return law


def _counts(twin, target_dir, drafter, session_factory=DraftSession, temperature=TEMPERATURE,
            num_sessions=NUM_SESSIONS, patches=(), **kw) -> tuple[Counter, dict]:
    """Sequence counts of ``num_sessions`` seeded sessions over real gRPC, half of them in the ``twin``
    process (each with its own in-process edge; ``patches`` apply in both), and the exact law.
    ``drafter``: a checkpoint directory or a ModelSpec."""
    cfg_kw = dict(temperature=temperature, max_new_tokens=N_TOKENS, draft_len=2, **kw)
    cfg = device_config(**cfg_kw)
    law = exact_law(str(target_dir), tuple(encode_prompt(load_spec(drafter).tokenizer, PROMPT, raw=True)),
                    temperature, cfg.target_top_k, cfg.target_top_p)
    results = split_sessions(twin, range(num_sessions), target_dir, drafter, cfg_kw, PROMPT, session_factory,
                             concurrency=CONCURRENCY, patches=patches)
    return Counter(tuple(tokens) for tokens, _, _ in results), law


PATCHES = {"dssd": [(verification, "DSSD_TAIL_SAMPLES", 1)]}


@pytest.mark.parametrize("name", list(MODES))
def test_mode_is_lossless_end_to_end(twin, tiny_pair_v8, name) -> None:
    counts, law = _counts(twin, *tiny_pair_v8, patches=PATCHES.get(name, ()), **MODES[name])
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    assert fit.p_value > P_VALUE_CUT, f"{name}: {fit}"


def test_dssd_fallbacks_cross_the_wire_as_heads_and_whole(tiny_pair_v8) -> None:
    """The "dssd" mode above over gRPC: some fallbacks are resolved from p_j's head (one trip), others
    run out of tail samples and fetch the whole p_j (two trips)."""
    results = split_sessions(None, range(40), *tiny_pair_v8, dict(temperature=TEMPERATURE, max_new_tokens=8,
                             draft_len=2, **MODES["dssd"]), PROMPT, patches=PATCHES["dssd"])
    fallbacks = sum(r.dssd_fallbacks for _, r, _ in results)
    trips = sum(r.dssd_residual_trips for _, r, _ in results)
    assert 0 < fallbacks < trips < 2 * fallbacks, (fallbacks, trips)


class EdgeBeforeHeadFallbacks(VerifierSession):
    """An edge from before the head fallback: whatever the request, the whole p_j."""

    def residual(self, request):
        return super().residual(replace(request, whole=True))


def test_an_edge_before_head_fallbacks_still_serves_the_fallback(tiny_pair_v8) -> None:
    results = split_sessions(None, range(40), *tiny_pair_v8, dict(temperature=TEMPERATURE, max_new_tokens=8,
                             draft_len=2, **MODES["dssd"]), PROMPT,
                             patches=[(servicer, "VerifierSession", EdgeBeforeHeadFallbacks)])
    fallbacks = sum(r.dssd_fallbacks for _, r, _ in results)
    assert 0 < fallbacks == sum(r.dssd_residual_trips for _, r, _ in results)  # one trip each, whole


def test_settings_changed_every_round_stay_lossless(twin, tiny_pair_v8) -> None:
    """Per-round settings (mode, K, lattice, tree changing between rounds of one session, as a
    controller would change them): each round is verified with the settings it says it used."""
    counts, law = _counts(twin, *tiny_pair_v8, session_factory=SwitchesEveryRound, **MODES["tslt"])
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"settings changed every round: {fit}")
    assert fit.p_value > P_VALUE_CUT, f"per-round settings: {fit}"


# The target's own top-k / top-p define the law: the verifier must apply them to every p it uses
# (accept test, residual, bonus). On this peaked target, T = 2 keeps 16 sequences in the filtered
# law, and filtering before the temperature instead of after it (as transformers does) moves it by
# a total variation of 0.29.
TARGET_FILTER = dict(temperature=2.0, target_top_k=5, target_top_p=0.9)


def test_target_top_k_top_p_through_the_verifier(twin, tiny_pair_v8) -> None:
    counts, law = _counts(twin, *tiny_pair_v8, **TARGET_FILTER, **MODES["tslt"])
    assert len(law) < len(exact_law(str(tiny_pair_v8[0]), tuple(counts_prompt(tiny_pair_v8)), 2.0)), \
        "the filters removed nothing: the test would not see them ignored"
    assert set(counts) <= set(law), "generated a sequence the filtered target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"target top-k 5, top-p 0.9, T 2: {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


class FiltersBeforeTemperature(VerifierSession):
    """Negative control, a classic: top-k / top-p applied to the untempered distribution."""

    def _target_probs(self, logits):
        h = self.hello
        scores = filter_target_logits(logits.cpu().float(), h.target_top_k or None, h.target_top_p or None)
        return torch.softmax(scores / h.temperature, dim=-1).double()


def test_control_target_filter_before_temperature_is_detected(twin, tiny_pair_v8) -> None:
    # a TV of 0.29 needs few samples (p ~ 1e-96 at 1500 sessions)
    counts, law = _counts(twin, *tiny_pair_v8, num_sessions=300, patches=[(servicer, "VerifierSession",
                          FiltersBeforeTemperature)], **TARGET_FILTER, **MODES["tslt"])
    outside = sum(c for seq, c in counts.items() if seq not in law)
    fit = goodness_of_fit(Counter({s: c for s, c in counts.items() if s in law}), law)
    print(f"control, filter before temperature: {outside} sequences outside the law, {fit}")
    assert outside > 0 or fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


class EdgeTokensShareOneUniform(VerifierSession):
    """Negative control for mode none: every edge-only token drawn with the uniform of the round's
    start instead of its own position's (a stream keyed by the wrong position): each token is still a
    draw from its p, but the tokens of a round are coupled, so the joint law is wrong."""

    def _edge_token(self) -> int:
        p = self._target_probs(self._feed_logits([], 1))[0]
        token = sample_token(p, stream(self.hello.seed, Purpose.EDGE_TOKEN, self._round_start))
        self.tokens.append(token)
        return token

    def generate(self, draft):
        self._round_start = len(self.tokens)
        return super().generate(draft)


def test_control_mode_none_with_one_uniform_per_round_is_detected(twin, tiny_pair_v8) -> None:
    counts, law = _counts(twin, *tiny_pair_v8, num_sessions=CONTROL_SESSIONS,
                          patches=[(servicer, "VerifierSession", EdgeTokensShareOneUniform)], **MODES["none"])
    fit = goodness_of_fit(counts, law)
    print(f"control, mode none with one uniform per round: {fit}")
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def counts_prompt(pair) -> list[int]:
    return encode_prompt(load(str(pair[1])).tokenizer, PROMPT, raw=True)


# The default drafter's construction on the tiny target: int4 decoder layers (bfloat16 activations)
# with a head that leaves out "<unk>" and "w5" (ids 0 and 7), which the target does emit: q = 0
# there, so those tokens only ever come from the edge's residual.
HEAD_IDS = (1, 2, 3, 4, 5, 6)


@pytest.fixture(scope="module")
def int4_reduced_head_drafter(tiny_pair_v8, tmp_path_factory) -> ModelSpec:
    """The drafter's ModelSpec (each process of the test loads it from there)."""
    target_dir, _ = tiny_pair_v8
    delta = tmp_path_factory.mktemp("int4_drafter")
    lean_drafter.save_drafter(delta, torch.tensor(HEAD_IDS), {"name": "tiny-int4", "num_layers": 2, "int4": True})
    spec = ModelSpec(model=str(target_dir), delta=str(delta), builder=lean_drafter.DELTA_BUILDER)
    assert isinstance(load_spec(spec).model.layers[0].qkv, lean_drafter.Int4Linear)  # int4 really runs
    return spec


def test_int4_reduced_head_drafter_is_lossless_end_to_end(twin, tiny_pair_v8, int4_reduced_head_drafter) -> None:
    target_dir, _ = tiny_pair_v8
    counts, law = _counts(twin, target_dir, int4_reduced_head_drafter, **MODES["tslt"])
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    off_head = sum(c for seq, c in counts.items() if set(seq) - set(HEAD_IDS))
    assert off_head > 0, "no token outside the head was generated: the test did not exercise q = 0"
    fit = goodness_of_fit(counts, law)
    assert fit.p_value > P_VALUE_CUT, f"int4 reduced-head drafter: {fit}"


class SamplesOtherQ(DraftSession):
    """Classic bug: the packet carries q_hat but the token is sampled from another law over the same
    support (here uniform on it, as when sampling and packet use different settings). Same support,
    so the edge's "q_hat(x) = 0" check cannot catch it: only the statistics can."""

    def sample(self, encoded, generator):
        super().sample(encoded, generator)  # draws what the honest device draws, then ignores it
        other = (encoded.q_hat > 0).double()
        token = int(torch.multinomial(other / other.sum(), 1, generator=generator))
        return DraftStep(token, encoded)


def test_control_device_sampling_other_q_is_detected(twin, tiny_pair_v8) -> None:
    # far outside the law: chi2 ~ 1e5 at 1500 sessions (p = 0), ~4e4 at 600
    counts, law = _counts(twin, *tiny_pair_v8, session_factory=SamplesOtherQ, num_sessions=CONTROL_SESSIONS,
                          **MODES["tslt"])
    fit = goodness_of_fit(counts, law)
    print(fit)
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def test_exact_law_is_a_distribution(tiny_pair_v8) -> None:
    target_dir, drafter_dir = tiny_pair_v8
    tok = load(str(drafter_dir)).tokenizer
    law = exact_law(str(target_dir), tuple(encode_prompt(tok, PROMPT, raw=True)))
    assert abs(sum(law.values()) - 1.0) < 1e-9
    assert all(len(s) == N_TOKENS or s[-1] == 1 for s in law)
    assert len(law) <= sum(8 ** k for k in range(1, N_TOKENS + 1))
