"""Same seed, same tokens (factory.DeviceConfig.reproducible): what a reproducible session may choose.

A seeded session at T > 0 must not let anything it learns from timing (mode auto's choices, the edge's
load advice) change where its random numbers land: mode auto keeps to the race modes (their tokens are
the target's own Gumbel-max draws with the position's noise), and a fixed mode drafts the length it
was given whatever the advice. At T = 0 every round gives the greedy tokens, so nothing is restricted;
without a seed (the daemon's requests that name none) nothing is either. The tokens themselves:
tests/integration/test_gumbel.py (in process) and test_batching_e2e.py (over gRPC, under load).
"""
from __future__ import annotations

import pytest

from specdec.common import protocol as P
from specdec.common.modes import Mode, RACE_MODES
from specdec.device import cli as device_cli
from specdec.device import openai_schema
from specdec.device.auto import AutoConfig, AutoPolicy, LinkTracker
from specdec.device.daemon import request_config
from specdec.device.factory import DeviceConfig, new_session
from specdec.testbed.tiny_models import make_model
from tests.support.harness import device_config, load

VOCAB = 64


def _hello(temperature: float, **draft) -> P.Hello:
    return device_config(temperature=temperature, **draft).hello("fp", VOCAB, seed=7)


def _modes(policy: AutoPolicy) -> set[Mode]:
    return {c.mode for c in policy.candidates}


@pytest.mark.parametrize("temperature, reproducible, race_only", [
    (1.0, True, True), (0.7, True, True), (0.0, True, False), (1.0, False, False)])
def test_auto_keeps_to_race_rounds_only_where_tokens_would_depend_on_its_choices(
        temperature, reproducible, race_only) -> None:
    policy = AutoPolicy(LinkTracker(), _hello(temperature, mode="auto"), VOCAB, reproducible=reproducible)
    assert (_modes(policy) <= RACE_MODES) == race_only
    assert Mode.GUMBEL in _modes(policy) and Mode.NONE in _modes(policy)
    # the edge's limits narrow the candidates; they never widen a reproducible session's
    policy.observe_welcome(P.Welcome(session_id="s", model_name="m", vocab_size=VOCAB, max_context=256,
                                     max_draft_len=4, max_k=32, modes=tuple(Mode)))
    assert (_modes(policy) <= RACE_MODES) == race_only
    assert max(c.draft_len for c in policy.candidates) <= 4


def test_without_race_candidates_a_reproducible_session_is_refused() -> None:
    config = AutoConfig(gumbel=False, edge_only=False)
    with pytest.raises(ValueError, match="gumbel or edge-only"):
        AutoPolicy(LinkTracker(config), _hello(1.0, mode="auto"), VOCAB, reproducible=True)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return load(str(make_model(tmp_path_factory.mktemp("drafter") / "m", VOCAB, seed=3)))


@pytest.mark.parametrize("mode, reproducible, advice, expected", [
    ("tslt", True, 0, ("tslt", 4)),     # a chain's tokens depend on where its rounds end: advice ignored
    ("tslt", True, 2, ("tslt", 4)),
    ("tslt", False, 0, ("none", None)),  # off: the load advice cuts the round as before
    ("tslt", False, 2, ("tslt", 2)),
    ("gumbel", True, 2, ("gumbel", 2)),  # a race round's tokens do not depend on its length: advice kept
    ("gumbel", True, 0, ("none", None)),
])
def test_fixed_modes_follow_the_load_advice_unless_it_would_change_tokens(
        drafter, mode, reproducible, advice, expected) -> None:
    cfg = device_config(temperature=1.0, mode=mode, draft_len=4, reproducible=reproducible)
    session = new_session(cfg, drafter, cfg.hello("fp", drafter.vocab_size, seed=7))
    session.edge_hint = advice
    settings = session.choose().settings
    assert settings.mode.value == expected[0]
    if expected[1] is not None:
        assert settings.draft_len == expected[1]


def test_greedy_fixed_modes_keep_following_the_advice(drafter) -> None:
    cfg = device_config(temperature=0.0, mode="tslt", draft_len=4)
    session = new_session(cfg, drafter, cfg.hello("fp", drafter.vocab_size, seed=7))
    session.edge_hint = 2
    assert session.choose().settings.draft_len == 2


@pytest.mark.parametrize("body, reproducible", [
    ({"prompt": "hi", "seed": 5}, True),
    ({"prompt": "hi"}, False),  # a fresh random seed per request: nothing to reproduce
])
def test_the_daemon_reproduces_requests_that_name_a_seed(body, reproducible) -> None:
    params = openai_schema.parse_completion(body).params
    assert request_config(DeviceConfig(), params).reproducible is reproducible
    assert request_config(DeviceConfig(reproducible=False), params).reproducible is False


def test_the_opt_out_flag() -> None:
    args = ["--edge", "127.0.0.1:1", "--prompt", "hi"]
    assert device_cli.config_from_args(device_cli.build_parser().parse_args(args)).reproducible is True
    off = device_cli.build_parser().parse_args([*args, "--no-reproducible"])
    assert device_cli.config_from_args(off).reproducible is False
    assert device_cli.build_serve_parser().parse_args(["--edge", "127.0.0.1:1", "--no-reproducible"]).reproducible \
        is False
