"""bench-truncation's measure of acceptance (the models themselves load only in make bench-truncation)."""
from __future__ import annotations

import pytest
import torch

from specdec.bench import bench_truncation as bt
from specdec.common.codecs import CodecConfig
from specdec.common.modes import Mode
from specdec.device.draft_model import encode_q


def test_acceptance_is_the_overlap_and_truncation_costs_at_most_sigma() -> None:
    """sum_x min(p, q_hat): 1 for q_hat = p, 1 - TV otherwise; truncating q to its top K costs at most
    the mass dropped (TSLT eq. 22's bound) and exactly that when p = q."""
    g = torch.Generator().manual_seed(0)
    V = 512
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.log(p) + 0.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    assert bt.acceptance(p, p) == pytest.approx(1.0)
    assert bt.acceptance(p, q) == pytest.approx(1 - 0.5 * float((p - q).abs().sum()))
    for k in (8, 64):
        q_hat = encode_q(q, CodecConfig(mode=Mode.TSLT, vocab_size=V, top_k=k)).q_hat
        sigma = 0.5 * float((q_hat - q).abs().sum())
        assert 0 < bt.acceptance(p, q) - bt.acceptance(p, q_hat) <= sigma + 1e-6
        q_hat_self = encode_q(p, CodecConfig(mode=Mode.TSLT, vocab_size=V, top_k=k)).q_hat
        assert bt.acceptance(p, q_hat_self) == pytest.approx(1 - 0.5 * float((q_hat_self - p).abs().sum()), abs=1e-3)


@pytest.mark.parametrize("flags", [["--temperature", "0"], ["--prompts", "0"], ["--max-new-tokens", "-1"]])
def test_bad_flags_exit_nonzero(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bt._args(flags)
    assert e.value.code != 0
