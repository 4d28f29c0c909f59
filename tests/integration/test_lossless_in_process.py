"""Every mode's exact law, in process: the device's round loop against a real edge session
(tests/support/inprocess.py), the product's own code on both sides but no gRPC (the transport paths
have their law tests over gRPC: test_lossless_e2e.py and the tree, batching and resume tests; the
modes those cover by default run here in the slow tier only, laws.TRANSPORT_PATHS).

Sessions and law as in tests/support/laws.py; the high-power runs of each of these over gRPC are in
the slow tier. Each law here that could hide a bug of its own has a negative control beside it.
"""
from __future__ import annotations

import pytest

from tests.conftest import INT4_HEAD_IDS
from tests.support.parts import SwitchesAndSamplesOtherQ, SwitchesEveryRound
from tests.support.laws import (GROSS_CONTROL_SESSIONS, MODES, TRANSPORT_PATHS, TREE_LAW, TREE_MODES, assert_lossless,
                                assert_rejected, exact_law, law_counts, prompt_ids)
from specdec.common import verification

PATCHES = {"dssd": [(verification, "DSSD_TAIL_SAMPLES", 1)]}  # both fallback replies (laws.MODES)
# The target's own top-k / top-p define the law (test_lossless_e2e.py: the control over gRPC).
TARGET_FILTER = dict(temperature=2.0, target_top_k=5, target_top_p=0.9)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in TRANSPORT_PATHS else n
                                  for n in MODES])  # TRANSPORT_PATHS: over gRPC by default (laws.py)
def test_mode_is_lossless(twin, tiny_pair_v8, name) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, patches=PATCHES.get(name, ()), **MODES[name])
    assert_lossless(counts, law, name)


@pytest.mark.parametrize("name", ["dense", "ksqs"])  # a TSLT tree: over gRPC (test_tree_e2e.py)
def test_branching_tree_is_lossless(twin, tiny_pair_v8, name) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, **TREE_LAW, **TREE_MODES[name])
    assert_lossless(counts, law, f"tree <2,2>, {name}")


def test_target_top_k_top_p_through_the_verifier(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, **TARGET_FILTER, **MODES["tslt"])
    assert len(law) < len(exact_law(str(tiny_pair_v8[0]), prompt_ids(tiny_pair_v8[1]), 2.0)), \
        "the filters removed nothing: the test would not see them ignored"
    assert_lossless(counts, law, "target top-k 5, top-p 0.9, T 2")


def test_int4_reduced_head_drafter_is_lossless(twin, tiny_pair_v8, int4_reduced_head_drafter) -> None:
    counts, law, _ = law_counts(twin, tiny_pair_v8[0], int4_reduced_head_drafter, **MODES["tslt"])
    off_head = sum(c for seq, c in counts.items() if set(seq) - set(INT4_HEAD_IDS))
    assert off_head > 0, "no token outside the head was generated: the test did not exercise q = 0"
    assert_lossless(counts, law, "int4 reduced-head drafter")


def test_settings_changed_every_round_stay_lossless(twin, tiny_pair_v8) -> None:
    """Per-round settings (mode, K, lattice, tree changing between rounds of one session, as a
    controller would change them): each round is verified with the settings it says it used."""
    counts, law, _ = law_counts(twin, *tiny_pair_v8, session_factory=SwitchesEveryRound, **MODES["tslt"])
    assert_lossless(counts, law, "per-round settings")


def test_control_per_round_settings_sampling_another_q_is_detected(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=GROSS_CONTROL_SESSIONS,
                                session_factory=SwitchesAndSamplesOtherQ, **MODES["tslt"])
    assert_rejected(counts, law, "per-round settings, device sampling another q")
