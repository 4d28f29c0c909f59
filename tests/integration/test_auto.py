"""mode auto end to end: a device whose controller changes mode, K and draft length (edge-only rounds
included) between rounds stays lossless, greedy and sampled, with tiny models: its exact law in
process (over real gRPC in the slow tier), its negative control and the rest over real gRPC."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from tests.support.harness import (device_cli, device_config, edge, load, run, run_sessions,
                                  target_greedy)
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt
from specdec.device.auto import AutoConfig, AutoDecision, AutoPolicy, LinkTracker
from specdec.device.rounds import RoundPlan
from specdec.device.session import DraftSession
from specdec.device.openai_schema import parse_overrides
from specdec.device.factory import DeviceConfig
from specdec.edge.verifier import EdgeLimits
from tests.support.laws import GROSS_CONTROL_SESSIONS, HIGH_POWER_SESSIONS, LAW_SESSIONS, N_TOKENS, PROMPT, law_counts
from tests.support.parts import SamplesOtherQ
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

AHEAD_KEPT_PER_SESSION = 20 / 1500  # at least: rounds drafted ahead and kept (> 20 at 1500 sessions)
# Candidates small enough for the 8-token vocabulary: supports 1-8, K-SQS on a coarse lattice.
TINY = AutoConfig(top_ks=(1, 3, 8), ksqs_ks=(3,), lattice=8, draft_lens=(1, 2, 3), dssd=True)  # every mode


class RandomAuto(AutoPolicy):
    """The real controller's plumbing (its settings, its observations) with choices drawn at random
    from every candidate, seeded by the session: many more transitions than a measured link gives
    (edge-only <-> drafted, DSSD <-> drafted ahead, K up and down), each a chance to get one wrong.
    Half the plans keep the last round's choice; half the edge-only rounds let the drafter catch up
    while they stream (a drafter cache fed in another thread, between rounds)."""

    def choose(self, in_flight=None, remaining=None):
        rng = random.Random(self.hello.seed * 1000 + len(self.last_choices))
        keep = self.current is not None and rng.random() < 0.5
        c = self.current if keep else rng.choice(self.candidates)
        self.last_choices.append(c.key)
        return RoundPlan(self.settings_for(c, rng.choice((1, 2, 9))), choice={"catch_up": rng.random() < 0.5, "retime": rng.choice((0, 3))},
                         decision=AutoDecision(c, None))


def random_auto_session(drafter, hello, session_class=DraftSession):
    policy = RandomAuto(LinkTracker(TINY), hello, drafter.vocab_size, draft_ahead=True)
    policy.last_choices = []
    session = session_class(drafter, hello, draft_ahead=True, policy=policy)
    session.events = []
    session.listeners.append(session.events.append)
    return session


def measured_auto_session(drafter, hello):
    policy = AutoPolicy(LinkTracker(TINY), hello, drafter.vocab_size, draft_ahead=True)
    return DraftSession(drafter, hello, draft_ahead=True, policy=policy)


def test_mode_auto_is_accepted_wherever_settings_are_given() -> None:
    assert DeviceConfig.of(mode="auto").auto and not DeviceConfig.of(mode="tslt").auto
    assert parse_overrides({"mode": "auto", "top_k": 32}) == {"mode": "auto", "top_k": 32}
    hello = DeviceConfig.of(mode="auto", top_k=32).hello("fp", 512, seed=0)
    assert hello.draft.mode is Mode.TSLT and hello.draft.top_k == 32  # auto starts from the table


def test_auto_is_the_default_of_sessions_given_no_draft_setting() -> None:
    """Where it beats the fixed default (every temperature, in the links benchmark); any draft setting
    keeps the fixed settings; the CLI and the daemon's per-request config derive from the same rule."""
    from specdec.device.cli import build_parser, config_from_args
    assert DeviceConfig().auto and DeviceConfig(temperature=1.0).auto
    assert DeviceConfig.of(mode="auto", temperature=1.0).auto and not DeviceConfig.of(mode="tslt").auto
    assert not DeviceConfig.of(draft_len=3).auto and not DeviceConfig.of(top_k=64, temperature=1.0).auto
    parse = build_parser().parse_args
    assert config_from_args(parse(["--edge", "h:1", "--prompt", "x", "--temperature", "1"])).auto
    assert not config_from_args(parse(["--edge", "h:1", "--prompt", "x", "--draft-len", "4"])).auto
    assert not config_from_args(parse(["--edge", "h:1", "--prompt", "x", "--mode", "tslt"])).auto


def test_greedy_auto_equals_the_target_greedy_decode(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    cfg = device_config(temperature=0.0, max_new_tokens=24, mode="auto")
    prompts = ["w1 w2 w3", "w7 w8", "w3 w9 w4 w1"]
    drafter = load(str(drafter_dir))

    async def main():
        async with edge(target_dir) as address:
            out = []
            for prompt in prompts:
                for factory in (random_auto_session, measured_auto_session):
                    out.append((prompt, factory, await run_sessions(address, drafter, cfg, prompt, [3], factory)))
            return out

    for prompt, factory, [(tokens, r, session)] in run(main()):
        ids = encode_prompt(drafter.tokenizer, prompt, raw=True)
        assert tokens == target_greedy(target_dir, ids, 24), (prompt, factory.__name__)
        if factory is random_auto_session:
            modes = {key.split("/")[0].split("-")[0] for key in session.policy.last_choices}
            assert len(modes) >= 3, modes  # the test exercised switches between modes


def _counts(twin, tiny_pair, factory, sessions: int, over_grpc: bool = False) -> tuple[Counter, dict, list]:
    """Sequence counts of seeded sessions (in process or over gRPC), half in the ``twin`` process."""
    # Sessions run past the tokens the law covers, so that rounds drafted ahead land inside them.
    return law_counts(twin, *tiny_pair, num_sessions=sessions, over_grpc=over_grpc, session_factory=factory,
                      max_new_tokens=N_TOKENS + 3, draft_len=None, mode="auto")


def test_random_auto_covers_every_kind_of_round(tiny_pair_v8) -> None:
    """What the law test below exercises: every mode, edge-only rounds among them."""
    target_dir, drafter_dir = tiny_pair_v8
    cfg = device_config(temperature=1.0, max_new_tokens=N_TOKENS + 3, mode="auto")

    async def main():
        async with edge(target_dir) as address:
            return await run_sessions(address, load(str(drafter_dir)), cfg, PROMPT, range(60), random_auto_session)

    sessions = [s for _, _, s in run(main())]
    kinds = Counter(key.split("/")[0] for s in sessions for key in s.policy.last_choices)
    assert {"none", "dssd", "dense"} <= set(kinds) and len(kinds) >= 6, kinds
    # edge-only rounds that timed the drafter as they streamed (the safety net's retime) recorded its
    # forwards, each fed one token; none did unasked
    streamed = [e for s in sessions for e in s.events if e.settings.mode is Mode.NONE]
    timed = [e.record.forward_s for e in streamed if e.plan.choice.get("retime")]
    assert len(timed) >= 3 and any(len(t) == 3 for t in timed) and all(min(t, default=1) > 0 for t in timed), timed
    assert not any(e.record.forward_s for e in streamed if not e.plan.choice.get("retime"))


def test_auto_stays_within_the_limits_of_a_smaller_edge(tiny_pair_v8) -> None:
    """An edge with a shorter longest draft, a smaller K cap and fewer DSSD samples than auto's
    candidates: every session completes (a round past a limit would fail it), every choice within."""
    target_dir, drafter_dir = tiny_pair_v8
    # the Hello's own settings within the limits too (the edge checks them when the session starts)
    cfg = device_config(temperature=1.0, max_new_tokens=N_TOKENS + 3, mode="auto", draft_len=2, top_k=3)
    limits = EdgeLimits(max_draft_len=2, max_k=3, dssd_max_samples=2)

    async def main():
        async with edge(target_dir, limits=limits) as address:
            return await run_sessions(address, load(str(drafter_dir)), cfg, PROMPT, range(30), random_auto_session)

    results = run(main())
    eos = set(load(str(drafter_dir)).eos_token_ids)
    assert all(len(tokens) >= N_TOKENS or tokens[-1] in eos for tokens, _, _ in results)  # none failed
    chosen = {c for _, _, s in results for c in s.policy.candidates}
    assert chosen and all(c.draft_len <= 2 and (c.top_k or 0) <= 3 for c in chosen), chosen
    assert all(s.policy.dssd_samples == 2 for _, _, s in results)


@pytest.mark.parametrize("sessions", [LAW_SESSIONS, pytest.param(HIGH_POWER_SESSIONS, marks=pytest.mark.slow)],
                         ids=["default", "high-power"])
def test_auto_switching_every_round_is_lossless(twin, tiny_pair_v8, sessions) -> None:
    """Over gRPC: rounds are drafted ahead while the edge verifies (in process nothing waits for a verdict)."""
    counts, law, results = _counts(twin, tiny_pair_v8, random_auto_session, sessions, over_grpc=True)
    kept_ahead = sum(s.stats.ahead_rounds_used for _, s in results)
    assert kept_ahead > sessions * AHEAD_KEPT_PER_SESSION, kept_ahead  # rounds drafted ahead were kept too
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"mode auto, random choices: {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


def random_auto_sampling_another_q(drafter, hello):
    """Control: the classic bug (the token is drafted from another law than the packet it sends,
    here uniform on the packet's support) under auto's switching: the law test must reject it."""
    return random_auto_session(drafter, hello, SamplesOtherQ)


def test_control_auto_with_a_device_sampling_another_q_is_detected(twin, tiny_pair_v8) -> None:
    counts, law, _ = _counts(twin, tiny_pair_v8, random_auto_sampling_another_q, GROSS_CONTROL_SESSIONS, over_grpc=True)
    fit = goodness_of_fit(counts, law)
    print(f"control under auto: {fit}")
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def test_cli_auto_round_log_names_each_choice_and_remembers_the_edge(tiny_pair_v512, edge_v512, tmp_path) -> None:
    """Each round's choice and estimates in the round log; a device-client process on an edge this
    device never used (its memory: an empty $SPECDEC_CACHE_DIR) starts with an edge-only round, the
    next process starts from what the first learned ($SPECDEC_CACHE_DIR/edges; --no-edge-memory:
    tests/unit/test_edge_memory.py). The shared edge process (conftest) serves them."""
    drafter_dir = tiny_pair_v512[1]
    env = {"SPECDEC_CACHE_DIR": str(tmp_path)}
    args = ("--edge", edge_v512.address, "--draft-model", str(drafter_dir), "--prompt", "w1 w2 w3", "--raw",
            "--mode", "auto", "--json", "--round-log", "--max-new-tokens", "16", "--temperature", "1")
    runs = [device_cli(*args, env=env), device_cli(*args, env=env)]
    bad = device_cli("--edge", edge_v512.address, "--prompt", "x", "--mode", "automatic")
    for out in runs:
        assert out.returncode == 0, out.stderr
    first, second = (json.loads(out.stdout) for out in runs)
    assert first["mode"] == "auto" and first["rounds"]
    assert sum(r["generated"] for r in first["rounds"]) >= 16
    for entry in first["rounds"] + second["rounds"]:
        auto = entry["auto"]
        assert auto["mode"] == entry["mode"] and auto["predicted_tokens_per_s"] > 0
        assert {"rtt_s", "uplink_bps", "alpha_base", "draft_s", "verify_base_s", "why"} <= set(auto)
    assert first["rounds"][0]["auto"]["why"] == "cold" and first["rounds"][0]["mode"] == "none"
    assert second["rounds"][0]["auto"]["why"] != "cold"
    # the second starts from the first's measurements, not from the priors a cold start has
    assert second["rounds"][0]["auto"]["verify_base_s"] != first["rounds"][0]["auto"]["verify_base_s"]
    assert len(list((tmp_path / "edges").glob("*.json"))) == 1
    assert bad.returncode != 0 and "auto" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
