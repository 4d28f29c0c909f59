"""Tests for specdec.device.conformal: SQS eq. (8), Alg. 1 checkpoint/backtrack, Theorem 2."""
import pytest
import torch

from specdec.device.conformal import ConformalController, conformal_update
from specdec.common.distributions import dropped_mass, probs_from_logits, truncate_threshold


def test_eq8_sign_and_value():
    # Dropped more than alpha -> the threshold goes down (keep more tokens), and vice versa.
    assert conformal_update(0.5, 0.3, 0.1, 0.5) == pytest.approx(0.4)
    assert conformal_update(0.5, 0.0, 0.1, 0.5) == pytest.approx(0.55)


def test_observe_updates_beta_in_sequence():
    c = ConformalController(alpha=0.1, eta=0.5, beta0=0.2)
    assert c.observe(0.3) == pytest.approx(0.1)
    assert c.observe(0.0) == pytest.approx(0.15)
    assert c.beta == pytest.approx(0.15)


def test_backtrack_after_rejection():
    c = ConformalController(alpha=0.1, eta=1.0, beta0=0.0)
    c.start_round()
    for d in (0.2, 0.4, 0.6, 0.8):  # updates -0.1, -0.3, -0.5, -0.7
        c.observe(d)
    assert c.beta == pytest.approx(-1.6)
    # Two accepted, the third position rejected: keep updates 1-2, redo 3, discard 4.
    assert c.on_verdict(2) == pytest.approx(-0.9)
    assert c.beta == pytest.approx(-0.9) and c.checkpoint is None and c.round_dropped == []


def test_backtrack_edge_cases():
    c = ConformalController(alpha=0.1, eta=1.0, beta0=0.0)
    c.start_round()
    for d in (0.2, 0.4):
        c.observe(d)
    assert c.on_verdict(2) == pytest.approx(-0.4)  # all accepted: bonus token was not drafted
    c.start_round()
    for d in (0.5, 0.5):
        c.observe(d)
    assert c.on_verdict(0) == pytest.approx(-0.8)  # first rejected: only its own update
    c.start_round()
    assert c.on_verdict(0) == pytest.approx(-0.8)  # nothing drafted: nothing changes


def test_round_equals_plain_stream_of_surviving_updates():
    drops = [0.05, 0.3, 0.0, 0.2, 0.15]
    c = ConformalController(alpha=0.1, eta=0.2, beta0=0.05)
    c.start_round()
    for d in drops:
        c.observe(d)
    c.on_verdict(2)
    plain = ConformalController(alpha=0.1, eta=0.2, beta0=0.05)
    for d in drops[:3]:
        plain.observe(d)
    assert c.beta == plain.beta


@pytest.mark.parametrize("args", [(0.0, 0.1, 0.0), (1.0, 0.1, 0.0), (0.1, 0.0, 0.0), (0.1, -1.0, 0.0),
                                  (float("nan"), 0.1, 0.0), (0.1, 0.1, float("inf")), (0.1, float("inf"), 0.0)])
def test_constructor_rejects_bad_parameters(args):
    with pytest.raises(ValueError):
        ConformalController(*args)


def test_bad_observations_and_verdicts():
    c = ConformalController(0.1, 0.1, 0.0)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            c.observe(bad)
    with pytest.raises(ValueError):
        c.on_verdict(0)  # no round open
    c.start_round()
    c.observe(0.2)
    for bad in (-1, 2, 0.5, True):
        with pytest.raises(ValueError):
            c.on_verdict(bad)


def synthetic_stream(T, seed):
    """Draft distributions of varying sharpness, like an SLM at temperature ~1."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(T, generator=g) * 6
    return [probs_from_logits(torch.randn(500, generator=g) * float(s), 1.0) for s in scales]


@pytest.mark.parametrize("alpha, eta, beta0", [(0.05, 0.05, 0.0), (0.1, 0.5, 0.3), (0.2, 0.01, -0.2)])
def test_telescoping_identity_and_theorem2_bound(alpha, eta, beta0):
    T = 400
    c = ConformalController(alpha, eta, beta0)
    drops = []
    for q in synthetic_stream(T, seed=int(alpha * 1000)):
        kept = truncate_threshold(q, c.beta)
        drops.append(dropped_mass(q, kept.ids))
        c.observe(drops[-1])
    # SQS Lemma 2: sum_t (dropped_t - alpha) = (beta_0 - beta_T) / eta, exactly up to rounding.
    assert sum(d - alpha for d in drops) == pytest.approx((beta0 - c.beta) / eta, abs=1e-9 / eta)
    # Lemma 3-4 lower bound on beta, then Theorem 2 / eq. (9).
    assert c.beta >= -eta * (1 - alpha) - 1e-12
    assert sum(drops) / T <= alpha + (abs(beta0) + 1 + eta * alpha) / (eta * T)


def test_bound_holds_over_rounds_with_backtracking():
    alpha, eta, beta0 = 0.1, 0.1, 0.0
    c = ConformalController(alpha, eta, beta0)
    g = torch.Generator().manual_seed(9)
    stream = iter(synthetic_stream(1200, seed=3))
    surviving = []
    for _ in range(300):
        c.start_round()
        round_drops = []
        for _ in range(4):
            q = next(stream)
            round_drops.append(dropped_mass(q, truncate_threshold(q, c.beta).ids))
            c.observe(round_drops[-1])
        n = int(torch.randint(0, 5, (), generator=g))
        c.on_verdict(n)
        surviving += round_drops[: n + 1] if n < 4 else round_drops
    T = len(surviving)
    assert sum(d - alpha for d in surviving) == pytest.approx((beta0 - c.beta) / eta, abs=1e-8)
    assert sum(surviving) / T <= alpha + (abs(beta0) + 1 + eta * alpha) / (eta * T)


def test_session_threshold_keeps_csqs_state_across_other_rounds_and_restarts_on_new_parameters() -> None:
    from specdec.common.modes import Mode
    from specdec.common.settings import DraftSettings
    from specdec.device.conformal import SessionThreshold

    csqs = DraftSettings(mode=Mode.CSQS, csqs_alpha=0.1, csqs_eta=0.5, csqs_beta0=0.01)
    tslt = DraftSettings(mode=Mode.TSLT)
    s = SessionThreshold()
    assert s.threshold(csqs) is None  # nothing before a C-SQS round started
    s.start_round(csqs)
    s.observe(csqs, 0.5)
    s.on_verdict(csqs, 0)
    beta = s.threshold(csqs)
    assert beta is not None and beta != 0.01 and s.threshold(tslt) is None
    s.start_round(tslt)                 # another mode's round: no call reaches the controller
    s.observe(tslt, 0.9)
    s.on_verdict(tslt, 3)
    assert s.threshold(csqs) == beta
    s.start_round(csqs)
    s.observe(csqs, 0.9)
    s.abort_round()                     # no verdict: back to the checkpoint
    assert s.threshold(csqs) == beta
    s.start_round(csqs)                 # a tree's path: the same as its positions one by one
    s.on_path(csqs, [0.2, 0.3, 0.4], [0, 2])
    path_beta = s.threshold(csqs)
    one = ConformalController(0.1, 0.5, beta)
    one.start_round()
    one.observe(0.2)
    one.observe(0.4)
    one.on_verdict(2)
    assert path_beta == pytest.approx(one.beta)
    s.start_round(DraftSettings(mode=Mode.CSQS, csqs_alpha=0.2, csqs_eta=0.5, csqs_beta0=0.07))
    assert s.threshold(csqs) == 0.07  # new parameters: a new controller from its beta0
