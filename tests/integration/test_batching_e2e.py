"""Many sessions in flight on one edge whose scheduler batches their target forwards.

Real gRPC on loopback, tiny real checkpoints. Every mode at once (chains, a token tree, DSSD,
edge-only), each session must still equal the target's own greedy decode, and the target law must
hold at T = 1 with eight sessions in flight; the edge's batch metrics prove that forwards were
shared (otherwise these tests would only repeat the single-session ones).
"""
from __future__ import annotations

import asyncio
import functools
from collections import Counter

import pytest

from tests.support.harness import assert_edge_flags_rejected, device_config, edge, load, run, run_sessions, target_greedy
from specdec.common.modeling import encode_prompt
from specdec.device.session import DraftSession
from specdec.device.safety_net import NetConfig
from specdec.edge.batching import BatchSettings, ForwardScheduler
from specdec.edge.metrics import EdgeMetrics
from tests.support.laws import HIGH_POWER_SESSIONS, N_TOKENS, PROMPT, TEMPERATURE, exact_law
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

PROMPTS = ["w1 w2 w3", "w40 w7", "w300 w301 w302 w303 w9"]
MAX_NEW = 12
# Every kind of forward the scheduler serves: chains of each codec, a tree, DSSD, edge-only tokens.
MIXED = {
    "tslt": dict(mode="tslt", top_k=16),
    "dense": dict(mode="dense", dense_dtype="fp16"),
    "ksqs": dict(mode="ksqs", top_k=16, lattice=64),
    "dssd": dict(mode="dssd", dssd_samples=2),
    "tree": dict(mode="tslt", top_k=16, tree=(2, 2)),
    "none": dict(mode="none"),
}
LAW_CONCURRENCY = 8


def mean_batch(metrics: EdgeMetrics) -> tuple[float, float]:
    """(forwards, mean sessions per forward) from the edge's own histogram."""
    samples = {s.name: s.value for m in metrics.batch_sessions.collect() for s in m.samples}
    count, total = samples["specdec_edge_batch_sessions_count"], samples["specdec_edge_batch_sessions_sum"]
    return count, total / max(count, 1)


@pytest.mark.parametrize("kv_cache", ["per-session", "slots", "slots-static"])
def test_every_mode_at_once_equals_target_greedy(accepting_pair_v512, kv_cache, monkeypatch) -> None:
    """Both layouts of the sessions' KV caches (each session's own, or a row of one preallocated
    cache: edge/slots.py, the GPU's default); slots-static: the GPU's serving path as far as a CPU
    runs it, the chain forwards in the static shapes that the GPU's CUDA graphs replay, run eagerly
    (only a GPU replays a graph: tests/gpu), and each forward's rounds verified while the next
    forward runs (verify_overlap)."""
    target_dir, drafter_dir = accepting_pair_v512
    metrics = EdgeMetrics()
    pools = []
    if kv_cache == "slots-static":
        from specdec.edge import batching, slots
        monkeypatch.setattr(batching, "SlotPool",
                            lambda *a, **kw: pools.append(slots.SlotPool(*a, **{**kw, "static": "eager"})) or pools[-1])

    async def main():
        overlap = "on" if kv_cache == "slots-static" else "auto"
        async with edge(target_dir, metrics=metrics, batching=BatchSettings(
                kv_cache=kv_cache.removesuffix("-static"), verify_overlap=overlap)) as address:
            jobs = [run_sessions(address, drafter_dir, device_config(temperature=0.0, max_new_tokens=MAX_NEW, **kw),
                                 prompt, [0]) for kw in MIXED.values() for prompt in PROMPTS]
            return await asyncio.gather(*jobs)

    done = run(main())
    results = iter(done)
    tok = load(str(drafter_dir)).tokenizer
    for name in MIXED:
        for prompt in PROMPTS:
            [(tokens, _, _)] = next(results)
            assert tokens == target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), MAX_NEW), \
                f"{name} prompt {prompt!r}"
    assert sum(session.stats.accepted_tokens for [(_, _, session)] in done) > 0  # drafts accepted in batches
    forwards, sessions = mean_batch(metrics)
    print(f"{forwards:.0f} forwards, {sessions:.2f} sessions per forward")
    assert sessions > 1.5, "the 18 sessions never shared a forward: batching did not run"
    samples = {s.name: s.value for m in metrics.batch_static.collect() for s in m.samples}
    static = samples["specdec_edge_batch_static_forwards_total"]
    if kv_cache == "slots-static":
        # chain forwards ran static (a forward that holds a tree round or a prompt does not: how many
        # do depends on which sessions the scheduler's timing puts together: once 15 of 31 under load);
        # the scheduler's forwards (the metric) and the start-up calibration's (the pool counts both)
        assert len(pools) == 1 and 0 < static <= pools[0].static_forwards, (static, forwards)
        assert pools[0].graph_captures == pools[0].graph_replays == 0  # a CPU: the static shapes ran eagerly
    else:
        assert static == 0
    # every Welcome states the edge's calibrated cost curve (mode auto's prior for its verify fit)
    curve = done[0][0][1].welcome.forward_cost
    assert len(curve) >= 5 and all(seconds > 0 for _, seconds in curve) and curve[0][0] == 1, curve


# Slow tier only: by default test_seeded_sessions_give_the_same_tokens_alone_and_eight_at_once checks
# that batched sessions give exactly the tokens they give alone, whose law test_lossless_e2e checks.
@pytest.mark.slow
def test_target_law_holds_with_eight_sessions_per_forward(tiny_pair_v8) -> None:
    target_dir, drafter_dir = tiny_pair_v8
    num_sessions = HIGH_POWER_SESSIONS
    metrics = EdgeMetrics()
    cfg = device_config(temperature=TEMPERATURE, max_new_tokens=N_TOKENS, draft_len=2, mode="tslt", top_k=3)

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            return await run_sessions(address, drafter_dir, cfg, PROMPT, range(num_sessions),
                                      concurrency=LAW_CONCURRENCY)

    counts = Counter(tuple(tokens) for tokens, _, _ in run(main()))
    law = exact_law(str(target_dir), tuple(encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True)))
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    forwards, sessions = mean_batch(metrics)
    print(f"{num_sessions} sessions, {forwards:.0f} forwards, {sessions:.2f} sessions per forward: {fit}")
    assert sessions > 1.5, "sessions did not share forwards: the law was not tested under batching"
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_batching_flags_derive_from_the_settings_and_bad_values_exit_with_one_line(capsys) -> None:
    from specdec.edge import __main__ as edge_cli
    from specdec.edge.batching import BatchSettings

    parse = edge_cli.build_parser().parse_args
    assert edge_cli.config_from_args(parse([])).batching == BatchSettings()
    cfg = edge_cli.config_from_args(parse(["--no-batching", "--max-batch-tokens", "64", "--batch-wait-ms", "0"]))
    assert cfg.batching == BatchSettings(enabled=False, max_batch_tokens=64, wait_s=0.0)
    cfg = edge_cli.config_from_args(parse(["--verify-overlap", "on", "--noise-ahead", "off"]))
    assert cfg.batching == BatchSettings(verify_overlap="on", noise_ahead="off")
    assert_edge_flags_rejected(capsys, (["--max-batch-tokens", "0"], ["--batch-wait-ms", "-1"],
                                        ["--batch-wait-ms", "nan"], ["--batch-wait-ms", "inf"],
                                        ["--max-batch-tokens", "x"], ["--verify-overlap", "yes"],
                                        ["--no-batching", "--verify-overlap", "on"]))


# The edge's advice in the order its verdicts give it: shorter than the device's L = 4, edge-only,
# longer than L (the device keeps its own), and back.
SCRIPTED_HINTS = (2, 0, 6, 1, 0, 3)


def test_device_drafts_no_longer_than_the_edge_advises(tiny_pair_v512, monkeypatch) -> None:
    """Load-aware speculation end to end: whatever length the edge advises (scripted here, since a
    test cannot load two cores the way 32 devices do), the next round drafts min(its own, advised),
    0 means edge-only rounds, and the output is still the target's greedy decode."""
    target_dir, drafter_dir = tiny_pair_v512
    given = iter((None,) + SCRIPTED_HINTS * 100)  # the Welcome's advice first: none
    monkeypatch.setattr(ForwardScheduler, "draft_len_hint", lambda self, alpha, max_len, sessions=None: next(given))
    cfg = device_config(temperature=0.0, max_new_tokens=40, mode="tslt", top_k=16, draft_len=4)

    async def main():
        async with edge(target_dir) as address:
            return await run_sessions(address, drafter_dir, cfg, PROMPTS[0], [0],
                                      session_factory=functools.partial(DraftSession, round_log=True))

    [(tokens, _, session)] = run(main())
    tok = load(str(drafter_dir)).tokenizer
    assert tokens == target_greedy(target_dir, encode_prompt(tok, PROMPTS[0], raw=True), 40)
    log = session.round_log
    advised = [None] + [entry["edge_hint"] for entry in log[:-1]]  # what each round was drafted under
    for entry, hint in zip(log, advised):
        if hint == 0:
            assert entry["mode"] == "none" and entry["drafted"] == 0, entry
        else:
            assert entry["mode"] == "tslt" and entry["drafted"] <= min(4, hint or 4), (hint, entry)
    assert {e["mode"] for e in log} == {"tslt", "none"}
    assert any(e["drafted"] == 4 for e in log), "advice above the device's own L must not shorten it"


@pytest.fixture
def busy_cpu_edge(monkeypatch) -> None:
    """A saturated CPU-shaped edge (its load and cost curve given: a test cannot load a core as eight
    devices do; the advice's formula is the real one)."""
    from specdec.common import loadaware
    from specdec.edge import batching
    from tests.unit.test_loadaware import CPU_135M
    monkeypatch.setattr(ForwardScheduler, "utilization", lambda self: 1.0)
    monkeypatch.setattr(ForwardScheduler, "active_sessions", lambda self: 8)
    monkeypatch.setattr(batching, "best_draft_len", lambda n, a, cost, max_len: loadaware.best_draft_len(
        n, a, CPU_135M, max_len))


def poor_drafter_sessions(target_dir, cfg, session_factory) -> list[list[dict]]:
    """Three sessions, one after the other, of a drafter that never guesses right (another random
    model) against a busy edge: their round logs, each session's tokens the target's greedy decode."""
    poor = load(str(target_dir.parent / "draft-v512"))

    async def main():
        async with edge(target_dir) as address:
            return await run_sessions(address, poor, cfg, PROMPTS[0], [0, 1, 2], session_factory=session_factory)

    results = run(main())
    greedy = target_greedy(target_dir, encode_prompt(poor.tokenizer, PROMPTS[0], raw=True), cfg.max_new_tokens)
    assert all(tokens == greedy for tokens, _, _ in results)
    return [session.round_log for _, _, session in results]


def test_a_busy_edge_sends_drafters_that_never_guess_right_edge_only(tiny_pair_v512, busy_cpu_edge) -> None:
    """Issue 35, item 5: at a saturated edge, a drafter that never guesses right is advised edge-only
    within two rounds, the next sessions from their Welcome on (the edge's recent drafts start a new
    session's estimate), and a device kept edge-only asks for longer and longer rounds; the output
    stays the target's greedy decode."""
    cfg = device_config(temperature=0.0, max_new_tokens=40, mode="tslt", top_k=8, draft_len=4)
    first, *later = poor_drafter_sessions(tiny_pair_v512[0], cfg, functools.partial(DraftSession, round_log=True))
    drafted = [e for e in first if e["mode"] != "none"]
    assert 1 <= len(drafted) <= 2 and sum(e["accepted"] for e in drafted) <= 1, first
    for log in later:
        assert all(e["mode"] == "none" for e in log), log  # advised 0 from the first round
        assert [e["generated"] for e in log][:3] == [8, 16, 16], log  # 8, 16, then the 16 left of 40


def test_auto_advised_edge_only_asks_for_rounds_its_boundary_model_pays_for(tiny_pair_v512, busy_cpu_edge) -> None:
    """Mode auto under the advice to draft nothing: its edge-only rounds are no shorter than its own
    model of a round's boundary asks (a round trip and the forward a busy batch makes without the
    session: ~20 tokens on loopback), not the 8 and 16 of a fixed mode's doubling, where each boundary
    costs a session an eighth of its forwards. The device's auto would draft (edge-only is not among its
    candidates: on this fast tiny edge it would choose edge-only on its own), so only the advice makes
    its rounds edge-only. Tokens stay the target's greedy decode."""
    from specdec.device.auto import AutoConfig, AutoPolicy, LinkTracker
    tracker = LinkTracker(AutoConfig(edge_only=False))  # one device: later sessions start from the first

    def auto_session(drafter, hello):
        policy = AutoPolicy(tracker, hello, drafter.vocab_size, draft_ahead=True)
        return DraftSession(drafter, hello, draft_ahead=True, policy=policy, round_log=True)

    cfg = device_config(temperature=0.0, max_new_tokens=40, mode="auto")
    first, *later = poor_drafter_sessions(tiny_pair_v512[0], cfg, auto_session)
    assert any(e["mode"] != "none" for e in first), first  # it drafts until the edge advises against it
    for log in later:
        assert all(e["mode"] == "none" for e in log), log  # advised 0 from the Welcome on
        assert all(e["generated"] > 2 * AutoConfig().edge_chunk_min for e in log[:-1]) and len(log) <= 2, log


# -- same seed, same tokens (factory.DeviceConfig.reproducible) -------------------------------------------
SEEDED = tuple(range(8))
SEEDED_TOKENS = 40


def _seeded_tokens(target_dir, drafter_dir, cfg, concurrency: int, advice, factory=None,
                   batching: BatchSettings = BatchSettings()):
    """Eight seeded T = 1 sessions on one batching edge that advises ``advice()`` in every verdict
    (None: no advice), ``concurrency`` at a time: their tokens, rounds by mode, mean sessions per forward."""
    metrics = EdgeMetrics()
    modes = Counter()

    def session(drafter, hello):
        s = (factory or _device_factory(cfg))(drafter, hello)
        s.listeners.append(lambda event: modes.update([event.settings.mode.value]))
        return s

    async def main():
        async with edge(target_dir, metrics=metrics, batching=batching) as address:
            return await run_sessions(address, drafter_dir, cfg, PROMPTS[1], SEEDED, session_factory=session,
                                      concurrency=concurrency)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ForwardScheduler, "draft_len_hint", lambda self, alpha, max_len, sessions=None: advice())
        results = run(main())
    return [tokens for tokens, _, _ in results], modes, mean_batch(metrics)[1]


def _device_factory(cfg):
    """Sessions as the device makes them (factory.new_session). Mode auto: every default candidate,
    drafting explored whenever it might pay and kept until measured below half edge-only's speed (on
    loopback edge-only rounds are cheap: at the net's own margin a loaded host's timings left runs with
    one drafted round among eight sessions, or none, and the comparison would test edge-only alone),
    edge-only rounds of at most 8 tokens, where drafting cannot pay too (a session of 40 has rounds to
    explore in, with explorations that fit; a longer chunk would take the session's tail with it: a
    drafter timed as slow as the target on a loaded host made the first edge-only round the whole
    session), each session with a fresh memory of the link."""
    from specdec.device.auto import AutoConfig, LinkTracker
    from specdec.device.factory import new_session
    return lambda drafter, hello: new_session(cfg, drafter, hello, LinkTracker(AutoConfig(
        memory=0.0, hysteresis=0.0, net=NetConfig(explore_cost=1.0, margin=-0.5), cold_start=False, edge_chunk_max=8,
        edge_round_unpaid_s=0.0)))


def test_seeded_sessions_give_the_same_tokens_alone_and_eight_at_once(accepting_pair_v512, tiny_pair_v512) -> None:
    """Issue 44: a seeded T = 1 session gives the same tokens alone on a quiet edge and among eight
    sessions on a batching edge whose load advice (scripted: a test cannot load two cores as 32 devices
    do) would cut its rounds elsewhere, and in mode auto with another drafter too, and with the race
    noise drawn by the sessions while the forwards run (edge/noise_ahead.py, a GPU edge's default).
    Each forward's numerics differ with the batch (padding, row order): a Gumbel-max over nearly tied
    scores could flip; none did here."""
    target_dir, close = accepting_pair_v512
    other = tiny_pair_v512[1]   # another random model of the same tokenizer: it hardly ever guesses right
    hints = iter(SCRIPTED_HINTS * 1000)
    auto = device_config(temperature=1.0, max_new_tokens=SEEDED_TOKENS, mode="auto")
    tslt = device_config(temperature=1.0, max_new_tokens=SEEDED_TOKENS, mode="tslt", top_k=16, draft_len=4)
    for name, cfg, drafters in (("auto", auto, (close, other)), ("tslt", tslt, (close,))):
        reference, modes, _ = _seeded_tokens(target_dir, close, cfg, 1, lambda: None)
        print(f"{name} alone: rounds by mode {dict(modes)}")
        for drafter in drafters:
            tokens, modes, batch = _seeded_tokens(target_dir, drafter, cfg, len(SEEDED), lambda: next(hints))
            print(f"{name}, eight at once, {batch:.2f} sessions per forward: rounds by mode {dict(modes)}")
            assert batch > 1.5
            assert tokens == reference, (name, str(drafter))
            assert modes["gumbel"] > 0 and set(modes) <= {"gumbel", "none"} if name == "auto" else "none" not in modes, \
                modes
        if name == "auto":
            assert _tokens_with_noise_ahead(target_dir, close, cfg) == reference


def _tokens_with_noise_ahead(target_dir, drafter_dir, cfg) -> list:
    """The eight sessions at once on an edge whose sessions draw their noise while the forwards run
    and whose rounds are verified while the next forward runs (a GPU edge's defaults); fails unless
    they drew some there (else the comparison would test nothing)."""
    from specdec.edge import batching
    drawn = []

    def counting(round_, done):
        drawn.append(batching_draw_ahead(round_, done))
        return drawn[-1]
    batching_draw_ahead = batching.draw_ahead
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batching, "draw_ahead", counting)
        tokens, modes, batch = _seeded_tokens(target_dir, drafter_dir, cfg, len(SEEDED), lambda: None,
                                              batching=BatchSettings(noise_ahead="on", verify_overlap="on"))
    print(f"noise ahead, eight at once, {batch:.2f} sessions per forward: {sum(drawn)} draws ahead in "
          f"{len(drawn)} rounds, rounds by mode {dict(modes)}")
    assert batch > 1.5 and sum(drawn) > len(drawn) // 2, (batch, sum(drawn), len(drawn))
    return tokens


def test_control_unreproducible_fixed_mode_follows_the_advice_and_gives_other_tokens(accepting_pair_v512) -> None:
    """Control for the test above: with reproducibility off the advice cuts the TSLT rounds elsewhere
    (edge-only rounds among them), and the tokens change."""
    target_dir, close = accepting_pair_v512
    hints = iter(SCRIPTED_HINTS * 1000)
    cfg = device_config(temperature=1.0, max_new_tokens=SEEDED_TOKENS, mode="tslt", top_k=16, draft_len=4,
                        reproducible=False)
    reference, _, _ = _seeded_tokens(target_dir, close, cfg, 1, lambda: None)
    tokens, modes, _ = _seeded_tokens(target_dir, close, cfg, len(SEEDED), lambda: next(hints))
    assert modes["none"] > 0, modes
    assert tokens != reference
