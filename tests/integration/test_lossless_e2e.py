"""Statistical losslessness over real gRPC: seeded sessions through a real edge server against the
target's exact law (tests/support/laws.py).

One law test per transport path runs here in the default tier (a chain, DSSD with both fallback
replies, the edge alone streaming); every mode's law runs in process (test_lossless_in_process.py)
and, at the higher power of the slow tier, here too. The negative controls run here, at the default
size: a device sampling another q than it sends, a residual not renormalised on the edge, the
target's filters applied before the temperature, edge-only tokens sharing one uniform.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.support.harness import load, split_sessions
from tests.support.parts import SamplesOtherQ, SwitchesEveryRound
from tests.support.laws import (CONTROL_SESSIONS, GROSS_CONTROL_SESSIONS, HIGH_POWER_SESSIONS, MODES, N_TOKENS,
                                PROMPT, TEMPERATURE, TRANSPORT_PATHS, assert_lossless, assert_rejected, exact_law,
                                law_counts)
from specdec.common import verification
from specdec.common.distributions import densify, filter_target_logits
from specdec.common.modeling import encode_prompt
from specdec.common.sampling import TargetLaw
from specdec.edge import servicer, verify_batch
from specdec.edge.verifier import VerifierSession

PATCHES = {"dssd": [(verification, "DSSD_TAIL_SAMPLES", 1)]}


@pytest.mark.parametrize("name", TRANSPORT_PATHS)
def test_transport_path_is_lossless_over_grpc(twin, tiny_pair_v8, name) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, over_grpc=True, patches=PATCHES.get(name, ()), **MODES[name])
    assert_lossless(counts, law, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODES))
def test_mode_is_lossless_end_to_end_high_power(twin, tiny_pair_v8, name) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=HIGH_POWER_SESSIONS, over_grpc=True,
                                patches=PATCHES.get(name, ()), **MODES[name])
    assert_lossless(counts, law, name)


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


@pytest.mark.slow
def test_settings_changed_every_round_stay_lossless_high_power(twin, tiny_pair_v8) -> None:
    """Per-round settings over gRPC (each Draft says how it was drafted); in process in the default tier."""
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=HIGH_POWER_SESSIONS, over_grpc=True,
                                session_factory=SwitchesEveryRound, **MODES["tslt"])
    assert_lossless(counts, law, "per-round settings")


# The target's own top-k / top-p define the law: the verifier must apply them to every p it uses
# (accept test, residual, bonus). On this peaked target, T = 2 keeps 16 sequences in the filtered
# law, and filtering before the temperature instead of after it (as transformers does) moves it by
# a total variation of 0.29.
TARGET_FILTER = dict(temperature=2.0, target_top_k=5, target_top_p=0.9)


@pytest.mark.slow
def test_target_top_k_top_p_through_the_verifier_high_power(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=HIGH_POWER_SESSIONS, over_grpc=True,
                                **TARGET_FILTER, **MODES["tslt"])
    assert_lossless(counts, law, "target top-k 5, top-p 0.9, T 2")


@dataclass(frozen=True)
class FilterFirstLaw(TargetLaw):
    """BROKEN, a classic: top-k / top-p applied to the untempered distribution."""

    def probs32(self, logits):
        scores = filter_target_logits(logits.float(), self.top_k or None, self.top_p or None)
        return torch.softmax(scores / self.temperature, dim=-1)


class FiltersBeforeTemperature(VerifierSession):
    """Negative control: an edge that verifies against the law filtered before the temperature."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.law = FilterFirstLaw(self.law.temperature, self.law.top_k, self.law.top_p)


def test_control_target_filter_before_temperature_is_detected(twin, tiny_pair_v8) -> None:
    # a TV of 0.29 needs few samples (p ~ 1e-96 at 1500 sessions)
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=300, over_grpc=True, patches=[
        (servicer, "VerifierSession", FiltersBeforeTemperature)], **TARGET_FILTER, **MODES["tslt"])
    assert_rejected(counts, law, "filter before temperature")


class EdgeTokensShareOneUniform(VerifierSession):
    """Negative control for mode none: every edge-only token raced with the noise of the round's start
    instead of its own position's (noise keyed by the round): each token is still a draw from its p,
    but the tokens of a round are coupled, so the joint law is wrong."""

    def token_noise(self, start: int, offset: int):
        return super().token_noise(start, 0)


def test_control_mode_none_with_one_uniform_per_round_is_detected(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=CONTROL_SESSIONS, over_grpc=True,
                                patches=[(servicer, "VerifierSession", EdgeTokensShareOneUniform)], **MODES["none"])
    assert_rejected(counts, law, "mode none with one uniform per round")


def unnormalised_residual(p: torch.Tensor, q_rows) -> torch.Tensor:
    """BROKEN: max(0, p - q) not renormalised (a one-line slip in verify_batch._residual_rows), [c, V]."""
    return torch.clamp(p - torch.stack([densify(sd, p.device) for sd in q_rows]), min=0.0)


def sample_as_if_normalised(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """An inverse-CDF sampler that trusts its rows to sum to one, as most do ([c, V], [c, m] -> [c, m]):
    against an unnormalised residual the missing mass falls to the last token it can return."""
    cdf = torch.cumsum(probs.double(), -1)
    idx = torch.searchsorted(cdf, u, right=True)
    last = torch.stack([torch.nonzero(row > 0).flatten()[-1] for row in probs]).unsqueeze(1)
    return torch.where(idx < probs.shape[-1], idx, last)


def test_control_residual_not_renormalised_is_detected(twin, tiny_pair_v8) -> None:
    """An edge bug: the correction token after a rejection drawn from the residual as if it summed to
    one (every honest sampler in the code scales by the total). Its bias is large (chi-square in the
    hundreds at CONTROL_SESSIONS), so it runs at the gross controls' size."""
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=GROSS_CONTROL_SESSIONS, over_grpc=True, patches=[
        (verify_batch, "_residual_rows", unnormalised_residual), (verify_batch, "inverse_cdf_rows", sample_as_if_normalised)],
        **MODES["tslt"])
    assert_rejected(counts, law, "residual not renormalised")


@pytest.mark.slow
def test_int4_reduced_head_drafter_is_lossless_end_to_end_high_power(twin, tiny_pair_v8,
                                                                    int4_reduced_head_drafter) -> None:
    counts, law, _ = law_counts(twin, tiny_pair_v8[0], int4_reduced_head_drafter, num_sessions=HIGH_POWER_SESSIONS,
                                over_grpc=True, **MODES["tslt"])
    assert_lossless(counts, law, "int4 reduced-head drafter")


def test_control_device_sampling_other_q_is_detected(twin, tiny_pair_v8) -> None:
    # far outside the law: chi2 ~ 1e5 at 1500 sessions (p = 0), ~4e4 at 600, ~3e3 at 150 (p ~ 1e-289)
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=GROSS_CONTROL_SESSIONS, over_grpc=True,
                                session_factory=SamplesOtherQ, **MODES["tslt"])
    assert_rejected(counts, law, "device sampling another q")


def test_exact_law_is_a_distribution(tiny_pair_v8) -> None:
    target_dir, drafter_dir = tiny_pair_v8
    tok = load(str(drafter_dir)).tokenizer
    law = exact_law(str(target_dir), tuple(encode_prompt(tok, PROMPT, raw=True)))
    assert abs(sum(law.values()) - 1.0) < 1e-9
    assert all(len(s) == N_TOKENS or s[-1] == 1 for s in law)
    assert len(law) <= sum(8 ** k for k in range(1, N_TOKENS + 1))
