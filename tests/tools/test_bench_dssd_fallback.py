"""bench-dssd-fallback's exact run-out chance and reply sizes (the models load only in make bench-dssd-fallback)."""
from __future__ import annotations

import pytest
import torch

from specdec.bench import bench_dssd_fallback as bd
from specdec.common.verification import dssd_device_resolve_head, dssd_edge_head


@pytest.mark.parametrize("top_k, n", [(1, 1), (2, 3)])
def test_run_out_is_the_chance_the_device_needs_the_whole_p(top_k: int, n: int) -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    head_ids = torch.topk(p, top_k).indices
    draws = 6000
    ran_out = sum(dssd_device_resolve_head(dssd_edge_head(p, top_k, n, g), q, g) is None for _ in range(draws))
    expected = bd.run_out(p, q, head_ids, n)
    assert 0.02 < expected < 0.98  # both outcomes common: the comparison means something
    assert ran_out / draws == pytest.approx(expected, abs=4 * (expected * (1 - expected) / draws) ** 0.5)


def test_reply_sizes() -> None:
    p = torch.full((1000,), 1e-3, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    assert 8000 < bd.reply_bytes(p) < 8100  # the whole p_j: 8 bytes an entry
    head = dssd_edge_head(p, 64, 16, g)
    assert 10 * 80 < bd.reply_bytes(p, head) < 12 * 80  # 8 + a 2-3 byte id per head entry or tail sample


@pytest.mark.parametrize("flags", [["--temperature", "0"], ["--prompts", "0"]])
def test_bad_flags_exit_nonzero(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bd.bt._args(flags, bd.__doc__)
    assert e.value.code != 0
