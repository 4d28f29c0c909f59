"""bench-coupling's exact race agreement and its flags (the models load only in make bench-coupling)."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.bench import bench_coupling as bc


def _pair(V: int, seed: int, zeros: bool = False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.log(p) + torch.randn(V, generator=g, dtype=torch.float64), 0)
    if zeros:  # the target's filters zero some of p, the drafter's head some of q, both some
        p[:3], q[2:5] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
    return p, q


@pytest.mark.parametrize("V, seed, zeros", [(6, 0, False), (40, 1, False), (40, 2, True)])
def test_race_agreement_is_the_monte_carlo_rate_within_the_coupling_bounds(V, seed, zeros) -> None:
    p, q = _pair(V, seed, zeros)
    n = 100_000
    e = -torch.log(torch.rand(n, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 10)))
    mc = float(((e / p).argmin(1) == (e / q).argmin(1)).double().mean())
    exact = bc.race_agreement(p, q)
    assert abs(exact - mc) < 5 * math.sqrt(mc * (1 - mc) / n)
    tv = 0.5 * float((p - q).abs().sum())
    assert (1 - tv) / (1 + tv) - 1e-12 <= exact <= 1 - tv + 1e-12


def test_race_agreement_of_equal_or_disjoint_laws() -> None:
    p, _ = _pair(30, 3)
    assert bc.race_agreement(p, p) == pytest.approx(1.0)
    one, other = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    one[0], other[1] = 1.0, 1.0
    assert bc.race_agreement(one, other) == 0.0
    assert bc.race_agreement(one, one) == 1.0


def test_gumbel_drafts_cost_two_bytes_a_position_at_the_default_vocabulary() -> None:
    w = bc.wire_bytes(49152)
    assert all(v["payload"] == 2.0 for v in w.values())
    assert w["L4"]["message"] <= 4.0 and w["L8"]["message"] <= 3.0
    # packed beats varints from a few ids on (the width costs a field); per-round settings cost more than both
    assert all(v["message"] < v["tslt_style_ids"] < v["message_with_settings"] for k, v in w.items() if k != "L1")


@pytest.mark.parametrize("flags", [["--temperatures", "-1"], ["--temperatures", "x"], ["--prompts", "0"],
                                   ["--seeds", "0"], ["--tree-draws", "0"]])
def test_bad_flags_exit_nonzero(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bc._args(flags)
    assert e.value.code != 0
