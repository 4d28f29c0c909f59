"""Load-aware speculation math (common/loadaware.py) and the device's cap (settings.within_draft_len)."""
from __future__ import annotations

import time

import pytest

from specdec.common import settings as S
from specdec.common.settings import Mode
from specdec.common.loadaware import Acceptance, CostCurve, best_draft_len, expected_tokens, goodput
from specdec.edge import batching
from specdec.edge.batching import BatchSettings, ForwardScheduler

# Roughly the embedded target on one CPU core (issue 19: 5 tokens 1.7x a 1-token forward, 80 tokens
# 6x), smoothed to an affine cost: the monotonicity below holds for convex costs, not for any
# measured curve with kinks.
CPU = CostCurve({t: 1.0 + 0.15 * (t - 1) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)})
FLAT = CostCurve({1: 1.0, 256: 1.05})  # a GPU far from saturation


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
        scheduler._done.update({i: now for i in range(64)})  # 64 sessions just ran a forward
        assert scheduler.utilization() == pytest.approx(0.9)
        assert scheduler.draft_len_hint(0.7, 16) == best_draft_len(64, 0.7, CPU, 16) == 0
        monkeypatch.setattr(batching, "ACTIVE_WINDOW_S", 1e-9)  # all of it is old now
        assert scheduler.utilization() == 0.0 and scheduler.active_sessions() == 0
    finally:
        scheduler.stop()
