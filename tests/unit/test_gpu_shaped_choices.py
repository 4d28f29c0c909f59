"""mode auto's pure model (device/autotune.py) reading the edge's measured cost curve.

The device's controller predicts each candidate's round time with the edge's verify time. Given the
edge's cost curve (common/loadaware.CostCurve, as the edge calibrates and refreshes it) instead of an
affine fit of its own short rounds, it sees what a GPU's forward costs: nearly nothing per extra
token (vLLM's fit of an 8B Llama on an H100), so a longer draft costs the device only its drafting,
and drafts come out longer than on a curve of a CPU's shape with the same single-token cost, and stay
long when other sessions share the forwards. What fixes the draft length on a GPU is then the
device's own drafting time and round trip (a fast edge makes a slow drafter the bottleneck). The
edge-side advice is tested in test_loadaware.py.
"""
from __future__ import annotations

import math

import pytest

from specdec.device import autotune as A
from specdec.common.loadaware import CostCurve
from specdec.common.modes import Mode

H100_8B = CostCurve.affine(5.886e-3 + 1.21e-3 + 0.039e-6 * 32 * 512, 21.0e-6)  # test_loadaware.py
CPU_135M = CostCurve.affine(0.0495, 6.5e-3)
# A CPU's shape at the H100's single-token cost: each further token costs 13 % of one token's forward.
_CPU_SLOPE = CPU_135M.fit_affine()[1] / CPU_135M(1)
CPU_SHAPED = CostCurve.affine(H100_8B(1) * (1 - _CPU_SLOPE), H100_8B(1) * _CPU_SLOPE)
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
CANDIDATES = A.candidate_grid((64,), LENGTHS, (), dense=False, dssd=False, edge_only=False)


def estimates(curve: CostCurve, **kw) -> A.Estimates:
    """A device on a fast link, acceptance 0.8, its verify times from ``curve``."""
    base = dict(rtt_s=0.02, uplink_bps=50e6, downlink_bps=50e6, draft_s=0.001, verify_base_s=1.0,
                verify_per_token_s=1.0, alpha_base=0.8, packet_bytes={(Mode.TSLT, 64): 320.0},
                verify_curve=curve)
    return A.Estimates(**{**base, **kw})


def chosen_len(e: A.Estimates) -> int:
    top, _ = A.best(CANDIDATES, e, draft_ahead=False)
    return top.candidate.draft_len


def test_the_curve_replaces_the_affine_fit_with_the_other_sessions_tokens() -> None:
    e = estimates(H100_8B, edge_batch_tokens=31 * 5)
    assert e.verify_s(5) == pytest.approx(H100_8B(160))
    affine = estimates(H100_8B, verify_curve=None, verify_base_s=0.05, verify_per_token_s=0.008)
    assert affine.verify_s(5) == pytest.approx(0.05 + 4 * 0.008)


@pytest.mark.parametrize("rtt_s, draft_s", [(0.002, 0.0005), (0.02, 0.001), (0.06, 0.001), (0.02, 0.005)])
def test_a_gpu_shaped_curve_drafts_longer_than_a_cpu_shaped_one(rtt_s, draft_s) -> None:
    gpu = chosen_len(estimates(H100_8B, rtt_s=rtt_s, draft_s=draft_s))
    cpu = chosen_len(estimates(CPU_SHAPED, rtt_s=rtt_s, draft_s=draft_s))
    assert gpu >= cpu, (gpu, cpu)
    if draft_s <= 0.001:  # drafting cheap next to a token's share of the CPU-shaped forward
        assert gpu > cpu and gpu >= 8, (gpu, cpu)


def test_on_the_h100_fit_sharing_the_forwards_keeps_drafts_long() -> None:
    """31 other sessions' rounds in the same forwards barely move a GPU's forward: the choice stays."""
    for rtt_s in (0.002, 0.02, 0.06):
        alone = chosen_len(estimates(H100_8B, rtt_s=rtt_s))
        shared = chosen_len(estimates(H100_8B, rtt_s=rtt_s, edge_batch_tokens=31 * 9))
        assert shared >= alone >= 6, (rtt_s, alone, shared)


def test_predicted_round_time_is_the_curve_at_the_rounds_tokens() -> None:
    e = estimates(H100_8B, uplink_bps=math.inf, downlink_bps=math.inf)
    p = A.predict(A.Candidate(Mode.TSLT, 8, 64), e, draft_ahead=False)
    assert p.seconds == pytest.approx(8 * 0.001 + 0.02 + H100_8B(9))
