"""Load-aware speculation math (common/loadaware.py) and the device's cap (settings.within_draft_len)."""
from __future__ import annotations

import time

import pytest

from specdec.common import settings as S
from specdec.common.modes import Mode
from specdec.common.loadaware import (Acceptance, CostCurve, RecentAcceptance, best_draft_len, expected_tokens,
                                      goodput)
from specdec.edge import batching
from specdec.edge.batching import BatchSettings, ForwardScheduler

# Roughly the embedded target on one CPU core (issue 19: 5 tokens 1.7x a 1-token forward, 80 tokens
# 6x), smoothed to an affine cost: the monotonicity below holds for convex costs, not for any
# measured curve with kinks.
CPU = CostCurve({t: 1.0 + 0.15 * (t - 1) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)})
FLAT = CostCurve({1: 1.0, 256: 1.05})  # a GPU far from saturation
# vLLM serving an 8B Llama on an H100 (SpecDecode-Bench's simulator, Llama8BH100): 5.886 ms + 21.0 us
# per batched token + 0.039 us per KV token, plus 1.21 ms per step; KV here: 32 sessions x 512 tokens.
H100_8B = CostCurve.affine(5.886e-3 + 1.21e-3 + 0.039e-6 * 32 * 512, 21.0e-6)
# The embedded target on one CPU core, as the edge calibrates it (issue 19's README figures: 56 ms for
# one token, then ~6.5 ms per token): seconds, not the relative units of CPU above.
CPU_135M = CostCurve.affine(0.0495, 6.5e-3)


def test_expected_tokens_is_leviathan_eq1() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_curve_interpolates_and_extrapolates() -> None:
    assert CPU(1) == 1.0 and CPU(0.5) == 1.0
    assert CPU(6) == pytest.approx(1.75)
    assert CPU(512) == pytest.approx(1.0 + 0.15 * 511)
    kinked = CostCurve({1: 1.0, 4: 1.5, 8: 4.0})
    assert kinked(6) == pytest.approx(2.75) and kinked(16) == pytest.approx(9.0)


def test_cost_curve_refreshes_the_nearest_point_slowly() -> None:
    curve = CostCurve({1: 1.0, 8: 2.0})
    curve.observe(8, 4.0)
    assert 2.0 < curve(8) < 3.0  # moved toward 4, not to it
    for _ in range(50):
        curve.observe(8, 4.0)
    assert curve(8) == pytest.approx(4.0, rel=1e-3)
    curve.observe(0, 1.0)  # nonsense is ignored
    curve.observe(8, 0.0)
    assert curve(8) == pytest.approx(4.0, rel=1e-3)


def test_flat_cost_drafts_as_long_as_allowed() -> None:
    assert best_draft_len(16, 0.7, FLAT, 8) == 8


def test_load_shortens_the_draft_down_to_edge_only() -> None:
    lengths = [best_draft_len(n, 0.7, CPU, 16) for n in (1, 2, 4, 8, 16, 32, 64)]
    assert lengths == sorted(lengths, reverse=True), lengths  # more sessions, never longer
    assert lengths[0] >= 3 and lengths[-1] == 0, lengths
    # at 64 sessions the edge alone beats any draft: one token each per forward is all it affords
    assert goodput(64, 0.7, 0, CPU) > goodput(64, 0.7, 1, CPU)


def test_better_acceptance_never_shortens_the_draft() -> None:
    for n in (1, 4, 8, 16):
        lengths = [best_draft_len(n, a, CPU, 16) for a in (0.3, 0.5, 0.7, 0.9)]
        assert lengths == sorted(lengths), (n, lengths)


def test_acceptance_is_the_geometric_mle_with_a_prior() -> None:
    a = Acceptance()
    assert a.alpha == pytest.approx(Acceptance.PRIOR)
    for _ in range(200):
        a.observe(drafted=4, accepted=1)  # 1 accepted, 2 positions tested: alpha = 0.5
    assert a.alpha == pytest.approx(0.5, abs=0.01)
    for _ in range(200):
        a.observe(drafted=4, accepted=4)  # nothing rejected: every position tested was accepted
    assert a.alpha > 0.99
    a.observe(drafted=0, accepted=0)  # an edge-only round says nothing about drafts


def test_a_new_session_starts_from_recent_drafts_and_edge_only_rounds_relax_toward_the_prior() -> None:
    """Issue 35, item 5: two rounds of a drafter that is never right bring the advice at a busy CPU
    edge to 0; a session starts where the edge's recent drafts were (those of every session), so the
    next device of a population of such drafters is advised 0 from its first round; while the advice
    keeps a session edge-only its estimate drifts back toward the prior (it is tried again)."""
    a = Acceptance()
    assert best_draft_len(8, a.alpha, CPU_135M, 16) > 0
    for _ in range(2):
        a.observe(drafted=4, accepted=0)
    assert best_draft_len(8, a.alpha, CPU_135M, 16) == 0
    recent = RecentAcceptance()
    for _ in range(16):  # eight devices' first two rounds
        recent.observe(drafted=4, accepted=0)
    start = Acceptance.starting_at(recent.alpha)
    assert recent.alpha < 0.1 and start.alpha == pytest.approx(recent.alpha)
    assert best_draft_len(8, start.alpha, CPU_135M, 16) == 0
    assert Acceptance.starting_at(0.95).alpha == pytest.approx(0.95)
    low = start.alpha
    start.relax(48)  # a session of edge-only rounds: still below what pays, but higher
    assert low < start.alpha < 0.4 and best_draft_len(8, start.alpha, CPU_135M, 16) == 0
    start.relax(2000)
    assert start.alpha == pytest.approx(Acceptance.PRIOR, abs=1e-3)


def test_within_draft_len_caps_chains_trees_and_goes_edge_only_at_zero() -> None:
    chain = S.resolve({"mode": "tslt", "draft_len": 6})
    assert S.within_draft_len(chain, None) == chain
    assert S.within_draft_len(chain, 8) == chain
    assert S.within_draft_len(chain, 2).draft_len == 2
    tree = S.resolve({"mode": "tslt", "tree": (2, 2, 2)})
    assert S.within_draft_len(tree, 2).tree == (2, 2)
    for s in (chain, tree, S.resolve({"mode": "dssd"})):
        none = S.within_draft_len(s, 0)
        assert none.mode is Mode.NONE and none.edge_tokens == S.EDGE_ONLY_CHUNK
        S.validate(none)  # a round the edge accepts
        assert S.within_draft_len(s, 0, 32).edge_tokens == 32
    already = S.resolve({"mode": "none"})
    assert S.within_draft_len(already, 3) == already


def test_scheduler_advises_the_longest_draft_until_the_edge_is_saturated(monkeypatch) -> None:
    scheduler = ForwardScheduler(BatchSettings())
    try:
        assert scheduler.draft_len_hint(0.7, 16) is None  # not calibrated yet: no advice
        scheduler.cost = CostCurve(dict(CPU.seconds))
        assert scheduler.draft_len_hint(0.7, 16) == 16  # idle: the device decides
        now = time.perf_counter()
        scheduler._busy.extend([(now, 0.45), (now, 0.45)])  # 90 % of the last second in forwards
        scheduler.arrivals.done.update({i: now for i in range(64)})  # 64 sessions just ran a forward
        assert scheduler.utilization() == pytest.approx(0.9)
        assert scheduler.draft_len_hint(0.7, 16) == best_draft_len(64, 0.7, CPU, 16) == 0
        monkeypatch.setattr(batching, "ACTIVE_WINDOW_S", 1e-9)  # all of it is old now
        assert scheduler.utilization() == 0.0 and scheduler.active_sessions() == 0
    finally:
        scheduler.stop()


def test_the_h100_fit_is_gpu_shaped_and_fits_back() -> None:
    """What the issue quotes: 5 tokens ~1.01x one token, 64 tokens ~1.2x, 256 tokens ~1.9x (here with
    its KV and per-step terms in the fixed cost); the affine fit recovers the line."""
    assert H100_8B(5) / H100_8B(1) < 1.02 and H100_8B(64) / H100_8B(1) < 1.25 and H100_8B(256) / H100_8B(1) < 1.9
    fixed, per_token = H100_8B.fit_affine()
    assert fixed == pytest.approx(7.7e-3, rel=0.01) and per_token == pytest.approx(21.0e-6, rel=1e-6)


def test_on_an_h100_the_advice_drafts_long_and_stays_long_under_load() -> None:
    """The same sessions and acceptance: on the GPU-shaped curve one session drafts as long as it may
    and 32 sessions still draft long, where the CPU's curve sends 32 sessions to short drafts."""
    gpu = [best_draft_len(n, 0.8, H100_8B, 32) for n in (1, 8, 32, 64)]  # [31, 14, 8, 6]
    cpu = [best_draft_len(n, 0.8, CPU_135M, 32) for n in (1, 8, 32, 64)]  # [7, 2, 1, 0]
    assert gpu == sorted(gpu, reverse=True), gpu
    assert gpu[0] >= 24 and gpu[2] >= 6 and gpu[3] >= 4, gpu  # 32 sessions x 9 tokens: 1.3x one token
    assert cpu[2] <= 2, cpu
    assert all(g > 2 * max(c, 1) for g, c in zip(gpu, cpu)), (gpu, cpu)


def test_on_an_h100_the_scheduler_waits_for_sessions_due_back() -> None:
    """Batching wide: on a flat curve one shared forward saves nearly a whole forward (~7.5 ms here),
    so a session due back sooner than that is waited for, and one due later is not."""
    saving = batching._saving(H100_8B, 31 * 8, 8)
    assert saving == pytest.approx(H100_8B(1) - 21.0e-6, rel=1e-6)  # c(a) + c(b) - c(a + b)
    assert batching._saving(None, 31 * 8, 8) == 0.0  # before calibration nothing is worth waiting for
    now = time.perf_counter()
    for due_in, waits in ((0.005, True), (0.020, False)):
        gap = 0.010 + due_in  # its last forward ended 10 ms ago
        arrivals = batching.Arrivals()
        arrivals.done, arrivals.gap, arrivals.size = {1: now - 0.010}, {1: gap}, {1: 8}
        until = arrivals.worth_waiting_for(now, set(), lambda joining: batching._saving(H100_8B, 31 * 8, joining))
        assert (until is not None) == waits, due_in
        if waits:
            assert until == pytest.approx(now + due_in + batching.DUE_TOLERANCE * gap)


def test_the_scheduler_defaults_follow_the_device() -> None:
    cpu, gpu = BatchSettings().resolved("cpu"), BatchSettings().resolved("cuda")
    assert (cpu.max_batch_tokens, cpu.kv_cache) == (256, "per-session")
    assert (gpu.max_batch_tokens, gpu.kv_cache) == (512, "slots")
    # 64 sessions x (7 drafts + 1) fit one GPU forward; the CPU's cap stays where its cost bends
    assert gpu.max_batch_tokens >= 64 * (best_draft_len(64, 0.8, H100_8B, 32) + 1)
    given = BatchSettings(max_batch_tokens=64, wait_s=0.0, kv_cache="slots").resolved("cpu")
    assert (given.max_batch_tokens, given.wait_s, given.kv_cache) == (64, 0.0, "slots")
    with pytest.raises(ValueError, match="kv_cache"):
        BatchSettings(kv_cache="paged").resolved("cpu")
    # CUDA graphs: on where slots run on CUDA, off elsewhere; asked for where they cannot run, an error
    assert (cpu.cuda_graphs, gpu.cuda_graphs) == ("off", "on")
    assert BatchSettings(kv_cache="per-session").resolved("cuda").cuda_graphs == "off"
    assert BatchSettings(cuda_graphs="off").resolved("cuda").cuda_graphs == "off"
    for settings, device in ((BatchSettings(cuda_graphs="on", kv_cache="slots"), "cpu"),
                             (BatchSettings(cuda_graphs="on", kv_cache="per-session"), "cuda"),
                             (BatchSettings(cuda_graphs="on", enabled=False), "cuda")):
        with pytest.raises(ValueError, match="CUDA graphs need"):
            settings.resolved(device)
    with pytest.raises(ValueError, match="cuda_graphs"):
        BatchSettings(cuda_graphs="yes").resolved("cuda")
