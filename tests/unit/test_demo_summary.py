"""`make demo`'s human summary (device/demo.py summary_lines) from a hand-built record."""
from __future__ import annotations

from specdec.device.demo import DENSE_FP16_BYTES, summary_lines

VOCAB = 1000


def _record(**stats) -> dict:
    base = dict(generated_tokens=40, wall_seconds=2.0, tokens_per_second=20.0, acceptance_rate=0.75,
                accepted_tokens=30, draft_positions=40, mean_accepted_length=3.0, rounds=10,
                uplink_bytes_per_token=100.0)
    return {"mode": "tslt", "token_ids": list(range(40)), "stats": {**base, **stats}}


def _alone(**kw) -> dict:
    return {"token_ids": list(range(40)), "wall_seconds": 4.0, "tokens_per_second": 10.0, "threads": 2,
            "vocab_size": VOCAB, **kw}


def test_summary_states_speed_speedup_acceptance_and_uplink() -> None:
    text = "\n".join(summary_lines(_record(), _alone(), temperature=0.0))
    assert "20.0 tok/s" in text and "10.0 tok/s" in text
    assert "speedup:              2.00x" in text
    assert "0.75 (30 of 40 drafted tokens)" in text and "3.00 accepted per round over 10 rounds" in text
    dense_per_token = VOCAB * DENSE_FP16_BYTES * 40 / 40  # one fp16 probability per entry per position
    assert f"dense fp16 would send {dense_per_token:,.0f} B" in text
    assert "1.0 positions per token" in text and "20x less" in text
    assert "same tokens as the target alone" in text


def test_dense_cost_scales_with_drafted_positions_per_token() -> None:
    text = "\n".join(summary_lines(_record(draft_positions=80), _alone(), temperature=0.0))
    assert "dense fp16 would send 4,000 B" in text and "2.0 positions per token" in text


def test_greedy_mismatch_is_reported_and_sampling_makes_no_claim() -> None:
    assert "TOKENS DIFFER" in "\n".join(summary_lines(_record(), _alone(token_ids=[1, 2]), temperature=0.0))
    assert not any("greedy" in line for line in summary_lines(_record(), _alone(), temperature=1.0))
