"""Device and edge over real gRPC on loopback, tiny real checkpoints: greedy identity, seeds, bytes."""
from __future__ import annotations

import pytest

from tests.support.parts import SwitchesEveryRound
from tests.support.harness import (ALL_MODES, device_config, edge, load, run, run_sessions,
                     target_greedy)
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt
from specdec.edge.metrics import EdgeMetrics

PROMPTS = ["w1 w2 w3", "w40 w7", "w300 w301 w302 w303 w9"]
MAX_NEW = 12


def _mode_kwargs(mode: Mode) -> dict:
    """Settings that make every mode actually compress on a 512-token vocabulary."""
    return {Mode.DENSE: {"dense_dtype": "fp16"}, Mode.TSLT: {"top_k": 16}, Mode.KSQS: {"top_k": 16, "lattice": 64},
            Mode.CSQS: {"csqs_beta0": 0.01, "lattice": 64, "max_k": 64}, Mode.DSSD: {"dssd_samples": 2}, Mode.NONE: {},
            Mode.GUMBEL: {}}[mode]


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_greedy_output_equals_target_alone(accepting_pair_v512, mode) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    cfg = device_config(mode=mode, temperature=0.0, max_new_tokens=MAX_NEW, **_mode_kwargs(mode))

    async def main():
        async with edge(target_dir) as address:
            return [await run_sessions(address, drafter_dir, cfg, prompt, [0]) for prompt in PROMPTS]

    results = run(main())
    tok = load(str(drafter_dir)).tokenizer
    for prompt, [(tokens, r, session)] in zip(PROMPTS, results):
        expected = target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), MAX_NEW)
        assert tokens == expected, f"{mode.value} prompt {prompt!r}"
        assert session.stats.rounds >= 1
        assert mode is Mode.NONE or session.stats.draft_tokens >= session.stats.rounds  # none drafts nothing
    if mode is not Mode.NONE:  # the accept path (and the KV rolled back past a rejection) ran at T = 0
        stats = [session.stats for [(_, _, session)] in results]
        assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats), mode


def test_greedy_with_settings_changed_every_round_equals_target(accepting_pair_v512) -> None:
    """A device that changes mode / K / lattice / tree between rounds of one session (per-round
    settings on the wire): still the target's greedy decode, and the edge saw several modes."""
    target_dir, drafter_dir = accepting_pair_v512
    cfg = device_config(temperature=0.0, max_new_tokens=MAX_NEW, top_k=16)
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            return [await run_sessions(address, drafter_dir, cfg, prompt, [i], SwitchesEveryRound)
                    for i, prompt in enumerate(PROMPTS)]

    tok = load(str(drafter_dir)).tokenizer
    results = run(main())
    for prompt, [(tokens, _, session)] in zip(PROMPTS, results):
        assert tokens == target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), MAX_NEW), prompt
        assert session.stats.rounds >= 3
    assert sum(session.stats.accepted_tokens for [(_, _, session)] in results) > 0
    modes = [m.value for m in Mode if metrics.registry.get_sample_value("specdec_edge_rounds_total", {"mode": m.value})]
    assert len(modes) >= 3, modes


@pytest.mark.parametrize("mode", [Mode.TSLT, Mode.CSQS, Mode.DSSD], ids=lambda m: m.value)
def test_seeded_sampling_run_is_reproducible(tiny_pair_v512, mode) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    cfg = device_config(mode=mode, temperature=1.0, max_new_tokens=16, **_mode_kwargs(mode))

    async def main():
        async with edge(target_dir) as address:
            a = await run_sessions(address, drafter_dir, cfg, PROMPTS[0], [7, 7, 8])
            b = await run_sessions(address, drafter_dir, cfg, PROMPTS[0], [7])
            return a + b

    (t1, *_), (t2, *_), (t3, *_), (t4, *_) = run(main())
    assert t1 == t2 == t4
    assert t3 != t1  # another seed gives another sample (16 tokens at T=1 over 512 tokens)


def test_uplink_bytes_are_serialized_draft_sizes_and_tslt_beats_dense(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            dense = await run_sessions(address, drafter_dir, device_config(
                mode=Mode.DENSE, dense_dtype="fp32", temperature=1.0, max_new_tokens=16), PROMPTS[0], [3])
            tslt = await run_sessions(address, drafter_dir, device_config(
                mode=Mode.TSLT, top_k=64, temperature=1.0, max_new_tokens=16), PROMPTS[0], [3])
            return dense[0][1], tslt[0][1]

    dense, tslt = run(main())
    seen = {m: metrics.registry.get_sample_value("specdec_edge_uplink_bytes_total", {"mode": m})
            for m in ("dense", "tslt")}
    # What the device counted is what the edge received, message for message.
    assert dense.uplink_bytes == seen["dense"] == sum(dense.round_uplink_bytes)
    assert tslt.uplink_bytes == seen["tslt"] == sum(tslt.round_uplink_bytes)
    dense_per_token = dense.uplink_bytes / len(dense.token_ids)
    tslt_per_token = tslt.uplink_bytes / len(tslt.token_ids)
    assert tslt_per_token * 4 < dense_per_token, (tslt_per_token, dense_per_token)


@pytest.mark.parametrize("mode", [Mode.KSQS, Mode.TSLT], ids=lambda m: m.value)
def test_bit_budget_sets_the_draft_length(tiny_pair_v512, mode) -> None:
    """SQS sec. 4: each round drafts the longest chain whose packets fit in B bits (at least one)."""
    target_dir, drafter_dir = tiny_pair_v512
    kw = {"top_k": 16, "lattice": 64} if mode is Mode.KSQS else {"top_k": 16}
    probe = device_config(mode=mode, temperature=1.0, max_new_tokens=24, draft_len=8, **kw)

    async def main(cfg):
        async with edge(target_dir) as address:
            return await run_sessions(address, drafter_dir, cfg, PROMPTS[0], [1])

    [(_, _, free)] = run(main(probe))
    bits_per_token = free.stats.theoretical_uplink_bits / free.stats.draft_tokens
    budget = int(2.5 * bits_per_token)  # room for about two positions per round
    [(tokens, r, s)] = run(main(probe.with_draft(bit_budget=budget)))
    assert len(tokens) == 24
    assert s.stats.theoretical_uplink_bits <= budget * s.stats.rounds
    assert s.stats.draft_tokens < 8 * s.stats.rounds  # the budget, not draft_len, bounded the rounds
    assert s.stats.draft_tokens >= s.stats.rounds
