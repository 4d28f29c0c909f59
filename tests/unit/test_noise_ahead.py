"""Noise drawn while the forward runs (edge/noise_ahead.py): each draw made once whoever asks, the
session's draws in the order verification reads them and no longer than its answer takes, and the
setting's defaults per device. That the verdicts stay the same is tests/unit/test_verify_batch.py's
``test_noise_drawn_ahead_gives_the_same_verdicts``; that a batching edge's tokens do,
tests/integration/test_batching_e2e.py."""
from __future__ import annotations

import threading

import pytest
import torch

from specdec.common.distributions import SparseDist
from specdec.common.sampling import TargetLaw
from specdec.edge.batching import DEVICE_DEFAULTS, BatchSettings
from specdec.edge.noise_ahead import Memo, draw_ahead
from specdec.edge.verify_batch import chain_round, gumbel_round

VOCAB = 16


class Draws:
    """A noise function that counts its draws, each ``torch.full(key)``; ``gate``: every draw waits for it."""

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None):
        self.keys: list[tuple] = []
        self.gate, self.fail_at = gate, fail_at
        self.lock = threading.Lock()

    def __call__(self, *key) -> torch.Tensor:
        with self.lock:
            self.keys.append(key)
        if self.gate is not None:
            assert self.gate.wait(5), "the test's gate never opened"
        if key and key[0] == self.fail_at:
            raise ValueError(f"no noise at {key[0]}")
        return torch.full((VOCAB,), 1.0 + (key[0] if key else 0), dtype=torch.float64)


def test_a_draw_is_made_once_whoever_asks_and_while_it_is_made_others_wait_for_it() -> None:
    gate = threading.Event()
    draws = Draws(gate)
    memo = Memo(draws)
    got: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: got.append(memo(3))) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(5)
    assert draws.keys == [(3,)], "one draw, not one per asking thread"
    assert len(got) == 8 and all(g is got[0] for g in got)
    assert memo.drawn(3) and not memo.drawn(4)
    assert memo(4)[0] == 5.0 and draws.keys == [(3,), (4,)]


def test_a_failed_draw_is_not_kept() -> None:
    draws = Draws(fail_at=1)
    memo = Memo(draws)
    for _ in range(2):
        with pytest.raises(ValueError, match="no noise at 1"):
            memo(1)
    assert draws.keys == [(1,), (1,)] and not memo.drawn(1)


def _gumbel(length: int, draws) -> object:
    return gumbel_round(torch.zeros(length, dtype=torch.int64), TargetLaw(1.0), Memo(draws))


def test_a_session_draws_its_race_positions_in_the_order_verification_reads_them() -> None:
    draws = Draws()
    r = _gumbel(4, draws)
    r.token_noise(2)  # verification (the scheduler's thread) got there first
    assert draw_ahead(r, lambda: False) == 4
    assert draws.keys == [(2,), (0,), (1,), (3,), (4,)]
    assert draw_ahead(r, lambda: False) == 0, "all kept: nothing drawn twice"


def test_a_session_stops_drawing_once_its_answer_is_there() -> None:
    draws = Draws()
    answered = iter([False, False, True])
    assert draw_ahead(_gumbel(6, draws), lambda: next(answered)) == 2
    assert draws.keys == [(0,), (1,)]


def test_a_chain_round_draws_its_coupled_bonus_and_a_plain_function_is_left_alone() -> None:
    sd = SparseDist(torch.tensor([0, 1]), torch.tensor([0.5, 0.5], dtype=torch.float64), VOCAB)
    draws = Draws()
    coupled = chain_round(torch.tensor([0, 1]), [sd, sd], TargetLaw(1.0), torch.Generator().manual_seed(0),
                          Memo(draws))
    assert draw_ahead(coupled, lambda: False) == 1 and draws.keys == [()]
    plain = Draws()
    assert draw_ahead(gumbel_round(torch.zeros(2, dtype=torch.int64), TargetLaw(1.0), plain), lambda: False) == 0
    assert plain.keys == [], "a function that keeps nothing would be drawn again by verification"


def test_a_failing_draw_stops_the_session_quietly_and_verification_meets_it() -> None:
    draws = Draws(fail_at=1)
    r = _gumbel(3, draws)
    assert draw_ahead(r, lambda: False) == 1  # position 0 drawn, position 1 failed: left to verification
    with pytest.raises(ValueError, match="no noise at 1"):
        r.token_noise(1)


def test_noise_ahead_is_on_where_the_forward_leaves_the_cores_idle() -> None:
    assert DEVICE_DEFAULTS["cpu"].noise_ahead == "off" and DEVICE_DEFAULTS["cuda"].noise_ahead == "on"
    assert BatchSettings().resolved("cpu").noise_ahead == "off"
    assert BatchSettings().resolved("cuda").noise_ahead == "on"
    assert BatchSettings(noise_ahead="on").resolved("cpu").noise_ahead == "on"
    assert BatchSettings(noise_ahead="off").resolved("cuda").noise_ahead == "off"
    with pytest.raises(ValueError, match="needs batching"):
        BatchSettings(enabled=False, noise_ahead="on").resolved("cpu")
    with pytest.raises(ValueError, match="noise_ahead must be one of"):
        BatchSettings(noise_ahead="yes").resolved("cpu")
