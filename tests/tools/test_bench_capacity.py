"""bench-capacity's pure parts: the plan, the replay scripts' bookkeeping (draft-ahead clock,
divergence, round limits), the recordings' storage, the analysis and goals. The benchmark itself
(make bench-capacity) is never run here."""
from __future__ import annotations


import pytest

from specdec.bench.capacity import analyze, plan
from specdec.bench.capacity import recording
from specdec.bench.capacity.scripts import Divergence, EdgeOnlyScript, GreedyScript, SessionScript, round_limit
from specdec.common import protocol as P
from specdec.common.codecs import Mode

EOS = 99


# ----------------------------------------------------------------------------- plan
def test_schedule_keeps_modes_of_one_n_together_and_rotates_them() -> None:
    s = plan.Settings(ns=(1, 2, 8), repeats=2)
    cells = plan.schedule(s, list(plan.MODES))
    assert len(cells) == 2 * 3 * 3
    for i in range(0, len(cells), 3):
        block = cells[i:i + 3]
        assert len({c.n for c in block}) == 1 and {c.mode for c in block} == set(plan.MODES)
    firsts = [cells[i].mode for i in range(0, 9, 3)]
    assert len(set(firsts)) == 3  # no mode always runs first after a change of N


def test_quick_preset_and_checks() -> None:
    q = plan.Settings.preset(True)
    assert q.ns == (1, 2, 8) and q.quick and q.max_new_tokens < plan.Settings().max_new_tokens
    assert plan.Settings().ns == (1, 2, 4, 8, 16, 32)
    for bad in (dict(ns=(0,)), dict(max_new_tokens=1), dict(temperatures=(-1.0,)), dict(modes=("x",)),
                dict(prompts=0), dict(edge_threads=0)):
        with pytest.raises(ValueError):
            plan.check(plan.Settings(**bad))
    plan.check(plan.Settings())


def test_recordings_needed_one_per_prompt_at_t0_one_per_session_above() -> None:
    s = plan.Settings(ns=(1, 4), prompts=2, temperatures=(0.0, 1.0))
    need = plan.recordings_needed(s)
    assert {x for x in need if x[0] == 0.0} == {(0.0, 0, 0), (0.0, 1, 0)}
    assert {x for x in need if x[0] == 1.0} == {(1.0, 0, 0), (1.0, 1, 1), (1.0, 0, 2), (1.0, 1, 3)}
    one = plan.Settings(ns=(1,), prompts=8)  # the validation's N = 2 needs a second client's recording
    assert plan.recordings_needed(one) == [(0.0, 0, 0), (0.0, 1, 0)]
    assert plan.recordings_needed(plan.Settings(ns=(1,), validate=False)) == [(0.0, 0, 0)]


def test_serving_modes_fall_back_to_todays_edge_without_batching_flags() -> None:
    chosen, skipped = plan.edge_kinds(set(), plan.MODES)
    assert chosen == {"unbatched": "plain"} and set(skipped) == {"batched", "edge-only"}
    chosen, skipped = plan.edge_kinds({"--no-batching", "--max-batch-tokens"}, plan.MODES)
    assert chosen == {"batched": "batched", "unbatched": "unbatched", "edge-only": "batched"} and not skipped
    assert plan.EDGES["unbatched"]["args"] == ["--no-batching"]


# ----------------------------------------------------------------------------- scripts
def hello(mode: Mode = Mode.TSLT, draft_len: int = 3) -> P.Hello:
    return P.Hello(vocab_fingerprint="f", vocab_size=100, temperature=0.0,
                   draft=P.DraftSettings(mode=mode, draft_len=draft_len))


def table(path: list[int], drafts: dict[int, list[int]], step: float = 0.01) -> recording.PositionTable:
    props = {i: recording.Proposal(d, [bytes([t]) for t in d], [step] * len(d)) for i, d in drafts.items()}
    return recording.PositionTable("p", [5, 6], path, props, b"", [EOS], len(path))


def verdict(round_id: int, n: int, nxt: int) -> P.Verdict:
    return P.Verdict(round_id=round_id, num_accepted=n, next_token=nxt)


def test_chain_limit_near_the_end() -> None:
    s = P.DraftSettings(draft_len=4)
    assert round_limit(s, 10) == 4 and round_limit(s, 3) == 2 and round_limit(s, 1) == 1


def test_greedy_replay_follows_the_edges_load_advice() -> None:
    pytest.importorskip("specdec.common.settings").within_draft_len  # load-aware speculation exists
    path = list(range(10, 30))
    sc = GreedyScript(table(path, {i: path[i:i + 3] for i in range(len(path))}), hello(), max_new=20)
    p = sc.next_round(hint=2)  # shorter drafts: the round says how it was drafted
    assert p.block.token_ids == (10, 11) and p.block.settings.draft_len == 2
    sc.on_verdict(p, verdict(1, 2, 12), wait_s=0.0)
    p = sc.next_round(hint=0)  # none pays: an edge-only chunk, no drafting
    assert p.block.token_ids == () and p.block.settings.mode is Mode.NONE and p.delay_s == 0.0
    assert 1 <= p.block.settings.edge_tokens <= 17
    for t in path[3:6]:
        assert sc.on_verdict(p, P.Verdict(round_id=2, num_accepted=0, next_token=t, more=True), 0.0) == [t]
    with pytest.raises(Divergence):  # a streamed token off the greedy path
        sc.on_verdict(p, P.Verdict(round_id=2, num_accepted=0, next_token=77, more=True), 0.0)
    p = sc.next_round(hint=None)
    assert p.block.settings is None and p.block.token_ids == tuple(path[6:9])


def test_greedy_replay_follows_the_path_and_sends_the_recorded_payloads() -> None:
    path = [10, 11, 12, 13, 14, 15, 16]
    drafts = {i: path[i:i + 3] + [0] * (3 - len(path[i:i + 3])) for i in range(len(path))}
    drafts[0] = [10, 11, 50]  # the drafter is wrong at position 2
    sc = GreedyScript(table(path, drafts), hello(), max_new=7)
    plan1 = sc.next_round()
    assert plan1.block.token_ids == (10, 11, 50) and plan1.block.distributions == (b"\n", b"\x0b", b"2")
    assert plan1.delay_s == pytest.approx(0.03)
    assert sc.on_verdict(plan1, verdict(1, 2, 12), wait_s=0.1) == [10, 11, 12]
    plan2 = sc.next_round()
    assert plan2.block.round_id == 2 and plan2.block.token_ids == (13, 14, 15)
    assert sc.on_verdict(plan2, verdict(2, 3, 16), wait_s=0.1) == [13, 14, 15, 16]
    assert sc.finished and sc.generated == path


def test_greedy_replay_reports_a_verdict_off_the_path() -> None:
    path = [10, 11, 12, 13]
    sc = GreedyScript(table(path, {i: path[i:i + 3] for i in range(4)}), hello(), max_new=4)
    p = sc.next_round()
    with pytest.raises(Divergence):
        sc.on_verdict(p, verdict(1, 1, 77), wait_s=0.0)


def test_draft_ahead_clock_right_guess_hides_drafting_in_the_wait() -> None:
    path = list(range(10, 30))
    step = 0.02
    sc = GreedyScript(table(path, {i: path[i:i + 3] for i in range(len(path))}, step), hello(), max_new=20)
    p = sc.next_round()
    sc.on_verdict(p, verdict(1, 3, 13), wait_s=0.05)  # all accepted, bonus = the drafter's argmax
    # ahead work: one feed (a step) + 3 steps = 0.08 s, 0.05 s of it done during the wait
    assert sc.next_round().delay_s == pytest.approx(0.03)
    sc2 = GreedyScript(table(path, {i: path[i:i + 3] for i in range(len(path))}, step), hello(), max_new=20)
    p = sc2.next_round()
    sc2.on_verdict(p, verdict(1, 3, 13), wait_s=1.0)  # a long wait: the next round is ready at once
    assert sc2.next_round().delay_s == 0.0


def test_draft_ahead_clock_wrong_guess_finishes_the_step_in_flight_then_drafts_afresh() -> None:
    path = list(range(10, 30))
    drafts = {i: path[i:i + 3] for i in range(len(path))}
    drafts[0] = [10, 11, 50]
    sc = GreedyScript(table(path, drafts, 0.02), hello(), max_new=20)
    p = sc.next_round()
    sc.on_verdict(p, verdict(1, 2, 12), wait_s=0.05)  # rejected: the ahead round is thrown away
    # in flight at 0.05: the step ending at 0.06 -> 0.01 s, then 3 fresh steps
    assert sc.next_round().delay_s == pytest.approx(0.01 + 0.06)


def test_greedy_replay_stops_at_eos_and_max_new() -> None:
    path = [10, EOS]
    sc = GreedyScript(table(path, {0: [10, EOS, 3], 1: [EOS, 3, 3]}), hello(), max_new=2)
    p = sc.next_round()
    assert len(p.block.token_ids) == 1  # one draft: the last token is the verdict's
    assert sc.on_verdict(p, verdict(1, 1, EOS), wait_s=0.0) == [10, EOS] and sc.finished


def test_greedy_replay_last_round_is_cut_at_the_recorded_length() -> None:
    path = [10, 11, 12, 13, 14]  # recorded to max_new_tokens = 5: the last bonus lies beyond it
    sc = GreedyScript(table(path, {i: (path[i:] + [7, 7, 7])[:3] for i in range(5)}), hello(), max_new=5)
    sc.on_verdict(sc.next_round(), verdict(1, 3, 13), wait_s=0.0)
    p = sc.next_round()
    assert p.block.token_ids == (14,)
    assert sc.on_verdict(p, verdict(2, 1, 55), wait_s=0.0) == [14] and sc.finished


def test_session_replay_sends_the_log_and_checks_each_verdict() -> None:
    from specdec.common import wire
    blocks = [P.DraftBlock(1, (3, 4), (b"a", b"b")), P.DraftBlock(2, (6, 7), (b"c", b"d"))]
    rounds = [recording.LoggedRound(wire.draft_to_pb(blocks[0]).SerializeToString(), 0.04, False, 2, 5),
              recording.LoggedRound(wire.draft_to_pb(blocks[1]).SerializeToString(), 0.05, True, 1, 8)]
    log = recording.SessionLog("p", [1], 7, 1.0, [3, 4, 5, 6, 8], rounds, b"", [EOS], 5)

    def decode(raw):
        from specdec.common.pb import speculative_pb2 as pb
        return wire.draft_from_pb(pb.DeviceMessage.FromString(raw).draft)
    sc = SessionScript(log, hello(), 5, decode)
    p = sc.next_round()
    assert p.block == blocks[0] and p.delay_s == pytest.approx(0.04)
    assert sc.on_verdict(p, verdict(1, 2, 5), wait_s=0.03) == [3, 4, 5]
    p = sc.next_round()
    assert p.delay_s == pytest.approx(0.02)  # drafted ahead: 0.05 s of drafting, 0.03 s of it in the wait
    with pytest.raises(Divergence):
        sc.on_verdict(p, verdict(2, 2, 9), wait_s=0.0)
    sc = SessionScript(log, hello(), 5, decode)
    assert sc.next_round(hint=1).block == blocks[0] and sc.hints_not_followed == 1  # no shorter draft in the log


def test_edge_only_asks_for_every_remaining_token() -> None:
    with pytest.raises(ValueError):
        EdgeOnlyScript(hello(), [1, 2], [EOS], 5)
    sc = EdgeOnlyScript(hello(Mode.NONE), [1, 2], [EOS], 3)
    p = sc.next_round()
    assert p.block.token_ids == () and p.block.settings.edge_tokens == 3 and p.delay_s == 0
    for t in (40, 41, 42):
        assert sc.on_verdict(p, P.Verdict(round_id=1, num_accepted=0, next_token=t, more=t != 42), 0.0) == [t]
    assert sc.finished


# ----------------------------------------------------------------------------- recordings
def test_recordings_round_trip_and_cache_keys(tmp_path) -> None:
    t = table([10, 11], {0: [10, 11], 1: [11, 3]})
    recording.save(t, tmp_path / "a.json.gz")
    back = recording.load(tmp_path / "a.json.gz")
    assert back.proposals[0].payloads == t.proposals[0].payloads and back.path == t.path
    assert recording.load(tmp_path / "missing.json.gz") is None
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    assert recording.load(tmp_path / "bad.json.gz") is None
    kw = dict(prompt="p", max_new_tokens=8, drafter="d", target="t", settings={"draft_len": 4})
    assert recording.cache_key(temperature=0.0, seed=1, **kw) == recording.cache_key(temperature=0.0, seed=2, **kw)
    assert recording.cache_key(temperature=1.0, seed=1, **kw) != recording.cache_key(temperature=1.0, seed=2, **kw)
    assert recording.cache_key(temperature=0.0, seed=0, **{**kw, "prompt": "q"}) != recording.cache_key(temperature=0.0, seed=0, **kw)


# ----------------------------------------------------------------------------- analysis
def session(client: int, events: list[tuple[float, int]], t_start: float = 0.0, **kw) -> dict:
    tok = sum(n for _, n in events)
    wall = events[-1][0] - t_start
    return {"client": client, "tokens": tok, "events": events, "t_end": events[-1][0], "t_start": t_start,
            "tokens_per_s": tok / wall, "ttft_s": events[0][0], "error": None, "divergence": None,
            "drafted": 4, "accepted": 3, **kw}


def test_cell_aggregate_counts_tokens_while_every_client_is_busy() -> None:
    a = session(0, [(1.0, 5), (2.0, 5)])
    b = session(1, [(1.0, 5), (2.0, 5), (4.0, 5), (8.0, 5)])
    st = analyze.cell_stats([a, b], 2)
    assert st["window_s"] == 2.0 and st["aggregate_tps"] == pytest.approx(20 / 2.0)
    assert st["makespan_tps"] == pytest.approx(30 / 8.0)
    assert st["per_device_p50"] == pytest.approx((5.0 + 2.5) / 2)
    assert st["per_device_p95"] < st["per_device_p50"]  # the tail: the slow end of tokens/s
    assert analyze.cell_stats([a], 2)["aggregate_tps"] is None  # a client with no session: no window
    eos = session(2, [(0.5, 3)])  # its answer ended at EOS after 3 tokens: it does not end the window
    st = analyze.cell_stats([a, b, eos], 3, full_tokens=10)
    assert st["window_s"] == 2.0 and st["aggregate_tps"] == pytest.approx(23 / 2.0)
    h = analyze.hint_stats([{**a, "hints": [None, 4, 0]}, {**b, "hints": [2], "hints_not_followed": 1}])
    assert h == {"rounds": 4, "hinted_rounds": 3, "mean_hint": 2.0, "zero_hints": 1, "hints_not_followed": 1}


def test_batch_stats_from_metrics_and_their_absence() -> None:
    before = analyze.parse_metrics("specdec_edge_batch_sessions_count 10\nspecdec_edge_batch_sessions_sum 20\n"
                                   "specdec_edge_batch_tokens_count 10\nspecdec_edge_batch_tokens_sum 50\n"
                                   'specdec_edge_batch_sessions_bucket{le="1.0"} 3\nother_metric 5\n'
                                   'specdec_edge_batch_cuda_graph_forwards_total{graph="replayed"} 4\n')
    after = analyze.parse_metrics("specdec_edge_batch_sessions_count 20\nspecdec_edge_batch_sessions_sum 60\n"
                                  "specdec_edge_batch_tokens_count 20\nspecdec_edge_batch_tokens_sum 150\n"
                                  "specdec_edge_batch_static_forwards_total 9\n"
                                  "specdec_edge_batch_verify_seconds_sum 0.25\n"
                                  'specdec_edge_batch_cuda_graph_forwards_total{graph="captured"} 2\n'
                                  'specdec_edge_batch_cuda_graph_forwards_total{graph="replayed"} 10\n'
                                  'specdec_edge_batch_cuda_graph_forwards_total{graph="failed"} 1\n')
    b = analyze.batch_stats(before, after)
    assert b["available"] and b["forwards"] == 10 and b["mean_sessions"] == 4.0 and b["mean_tokens"] == 10.0
    assert b["verify_s"] == 0.25 and b["static_forwards"] == 9 and b["graphs"] == {"captured": 2, "replayed": 6, "failed": 1}
    assert analyze.batch_stats({}, analyze.parse_metrics("other 1\n")) == {"available": False}


def combined(agg: float, p95: float) -> dict:
    return {"aggregate_tps": agg, "per_device_p95": p95}


def test_goals_pass_and_miss_from_ratios() -> None:
    table = {"batched": {"1": combined(30, 20), "8": combined(100, 9)},
             "unbatched": {"1": combined(28, 20), "8": combined(30, 4)},
             "edge-only": {"1": combined(32, 25), "8": combined(40, 5)}}
    g = analyze.goals({"T0": table})["T0"]
    assert g["batched_vs_unbatched_N8"]["pass"] and g["batched_vs_unbatched_N8"]["value"] == pytest.approx(100 / 30)
    assert g["batched_vs_edge_only_N8"]["pass"]
    assert not g["never_below_edge_only"]["pass"] and "N = 1" in g["never_below_edge_only"]["where"]
    assert g["p95_N8_vs_N1"]["pass"] and g["p95_N8_vs_N1"]["value"] == pytest.approx(0.45)
    missing = analyze.goals({"T0": {"unbatched": table["unbatched"]}})["T0"]
    assert all(x["pass"] is None for x in missing.values())


def test_validation_ratio_and_its_explanation_per_n() -> None:
    real = {1: [{"stats": {"tokens_per_second": 20.0, "generated_tokens": 48, "rounds": 10, "draft_tokens": 38,
                           "draft_ahead": {"tokens_discarded": 2, "rounds_used": 10}, "time": {"draft": 1.8, "encode": 0.2, "verify": 2.0}}}]}
    replay = {1: [session(0, [(1.0, 12), (2.0, 12)], rounds=8, edge_s=0.8),
                  session(1, [(1.0, 12)], divergence="off the path", rounds=1, edge_s=0.1)]}
    v = analyze.validation(real, replay)["1"]
    assert v["ratio"] == pytest.approx(12.0 / 20.0) and v["replay_sessions"] == 1  # a diverged one is left out
    assert v["real_draft_ms_per_step"] == pytest.approx(2.0 / 50 * 1e3)
    assert v["real_edge_ms_per_round"] == pytest.approx(200.0) and v["replay_edge_ms_per_round"] == pytest.approx(100.0)
    assert analyze.real_step_s(real[1]) == pytest.approx(0.04)


def test_greedy_replay_scales_its_drafting_times() -> None:
    path = list(range(10, 20))
    t = table(path, {i: path[i:i + 3] for i in range(len(path))}, 0.01)
    assert GreedyScript(t, hello(), 10, draft_scale=3.0).next_round().delay_s == pytest.approx(0.09)
