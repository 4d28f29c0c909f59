"""A round retried on another edge after a broken stream is drafted within that edge's limits.

The retried round keeps its plan where the new edge takes it (its random numbers were drawn for it);
where the new edge states a shorter longest draft, a smaller K, fewer DSSD samples, or (mode auto) does
not verify the round's mode, a fixed mode drafts it cut to the limits and mode auto chooses again among
what the new edge takes, instead of the edge refusing the round and the session failing.
"""
from __future__ import annotations

import pytest

from specdec.common import protocol as P
from specdec.common import settings as S
from specdec.common.modes import Mode
from specdec.device.factory import new_session
from specdec.device.session import DraftSession
from specdec.testbed.tiny_models import make_model
from tests.support.harness import device_config, load

VOCAB = 64
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return load(str(make_model(tmp_path_factory.mktemp("drafter") / "m", VOCAB, seed=3)))


def welcome(max_draft_len: int = 16, max_k: int = 4096, dssd_max_samples: int = 64, modes=tuple(Mode)) -> P.Welcome:
    return P.Welcome(session_id="s", model_name="m", vocab_size=VOCAB, max_context=256, max_draft_len=max_draft_len,
                     max_k=max_k, dssd_max_samples=dssd_max_samples, modes=modes)


def broken_round(drafter, **cfg):
    """A session whose round in flight broke (its plan fixed for the retry), and that round's settings."""
    c = device_config(temperature=1.0, **cfg)
    session = new_session(c, drafter, c.hello("fp", drafter.vocab_size, seed=7))
    session.start(PROMPT)
    session.observe_welcome(welcome())
    rd = session.draft(session.plan(), 32)
    session.abort_round()
    return session, rd.settings


@pytest.mark.parametrize("cfg, limits, expected", [
    (dict(mode="tslt", draft_len=8, top_k=32), dict(max_draft_len=4, max_k=16), dict(draft_len=4, top_k=16)),
    (dict(mode="csqs", draft_len=6, max_k=64), dict(max_k=32), dict(draft_len=6, max_k=32)),
    (dict(mode="dssd", draft_len=6, dssd_samples=8), dict(max_draft_len=2, dssd_max_samples=3),
     dict(draft_len=2, dssd_samples=3)),
    (dict(mode="tslt", top_k=16, tree=(2, 2, 2)), dict(max_draft_len=2), dict(tree=(2, 2))),
])
def test_a_fixed_mode_retries_its_round_cut_to_the_new_edges_limits(drafter, cfg, limits, expected) -> None:
    session, before = broken_round(drafter, **cfg)
    session.observe_welcome(welcome(**limits))
    plan = session.plan()
    assert plan.retry
    assert {k: getattr(plan.settings, k) for k in expected} == expected
    assert plan.settings.mode is before.mode


def test_a_retry_the_new_edge_takes_keeps_its_plan(drafter) -> None:
    session, before = broken_round(drafter, mode="tslt", draft_len=4, top_k=16)
    session.observe_welcome(welcome(max_draft_len=4, max_k=16))
    plan = session.plan()
    assert plan.retry and plan.settings == before


def test_mode_auto_chooses_again_within_the_new_edge(drafter) -> None:
    """Auto's round in flight was gumbel at length 16; the new edge takes drafts of 3 at most and no
    gumbel rounds: the retry is chosen again among what it takes."""
    from specdec.device.autotune import Candidate
    from specdec.device.auto import AutoConfig, AutoPolicy, LinkTracker
    from specdec.device.rounds import RoundPlan
    c = device_config(temperature=1.0, mode="auto")
    hello = c.hello("fp", drafter.vocab_size, seed=7)
    config = AutoConfig(top_ks=(16,), ksqs_ks=(), dense=False, dssd=False, draft_lens=(3, 16), cold_start=False)
    policy = AutoPolicy(LinkTracker(config), hello, drafter.vocab_size)
    session = DraftSession(drafter, hello, policy=policy, draft_ahead=c.draft_ahead, reproducible=c.reproducible)
    session.start(PROMPT)
    session.observe_welcome(welcome())
    gumbel16 = Candidate(Mode.GUMBEL, draft_len=16)
    assert gumbel16 in policy.candidates
    session.draft(RoundPlan(policy.settings_for(gumbel16, 8)), 32)
    session.abort_round()
    assert session._next.retry and session._next.settings.mode is Mode.GUMBEL
    session.observe_welcome(welcome(max_draft_len=3, modes=tuple(m for m in Mode if m is not Mode.GUMBEL)))
    plan = session.plan()
    assert not plan.retry
    assert plan.settings.mode is not Mode.GUMBEL
    assert plan.settings.mode is Mode.NONE or plan.settings.draft_len <= 3


def test_within_limits_leaves_an_edge_only_round_and_unstated_limits_alone() -> None:
    s = S.resolve(dict(mode="tslt", draft_len=8, top_k=64), vocab_size=VOCAB)
    assert S.within_limits(s) == s
    none = S.resolve(dict(mode="none", edge_tokens=40), vocab_size=VOCAB)
    assert S.within_limits(none, max_draft_len=1, max_k=1) == none
