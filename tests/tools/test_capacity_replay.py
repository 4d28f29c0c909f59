"""bench-capacity's replay against a real edge (tiny random models): recorded by the recorder's own
code, replayed by the load generator's clients, several at once. At T = 0 every replayed session
must deliver the target's greedy tokens without a divergence; at T = 1 the replayed session must get
the recorded verdicts (the edge draws from the same seed) and so the recorded tokens; edge-only
clients must deliver the greedy tokens too."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.support.harness import edge, load, run, target_greedy
from specdec.common import wire
from specdec.common.pb import speculative_pb2 as pb
from specdec.device.factory import DeviceConfig, edge_channel

from specdec.bench.capacity import recording
from specdec.bench.capacity.record import record_job
from specdec.bench.capacity.replay import edge_only_hello, run_cell
from specdec.bench.capacity.scripts import EdgeOnlyScript, GreedyScript, SessionScript

PROMPT = "w1 w2 w3 w4"
MAX_NEW = 20
CLIENTS = 3


def hello_of(rec):
    return wire.hello_from_pb(pb.DeviceMessage.FromString(rec.hello).hello)


def decode(raw: bytes):
    return wire.draft_from_pb(pb.DeviceMessage.FromString(raw).draft)


def test_replayed_sessions_reproduce_real_ones(tiny_pair_v512, tmp_path) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    choice = SimpleNamespace(operating_point={})
    jobs = {t: {"prompt": PROMPT, "temperature": t, "seed": 7, "max_new_tokens": MAX_NEW,
                "out": str(tmp_path / f"T{t:g}.json.gz")} for t in (0.0, 1.0)}

    async def main():
        async with edge(target_dir) as address:
            async with edge_channel(DeviceConfig(edge=address)) as channel:
                for job in jobs.values():
                    await record_job(channel, drafter, choice, address, job)
            greedy, log = recording.load(Path(jobs[0.0]["out"])), recording.load(Path(jobs[1.0]["out"]))
            g_hello, s_hello = hello_of(greedy), hello_of(log)
            _, replayed = await run_cell(address, [[lambda: GreedyScript(greedy, g_hello, MAX_NEW)]] * CLIENTS,
                                         "replay")
            _, sampled = await run_cell(address, [[lambda: SessionScript(log, s_hello, MAX_NEW, decode)]] * 2,
                                        "replay")
            none_hello = edge_only_hello(g_hello)
            _, alone = await run_cell(address, [[lambda: EdgeOnlyScript(none_hello, greedy.prompt_ids,
                                                                        greedy.eos_ids, MAX_NEW)]] * 2, "edge-only")
            return greedy, log, replayed, sampled, alone

    greedy, log, replayed, sampled, alone = run(main())
    assert greedy.path == target_greedy(target_dir, greedy.prompt_ids, MAX_NEW)[:len(greedy.path)]
    assert set(greedy.proposals) == set(range(len(greedy.path)))
    assert all(p.step_s and len(p.payloads) == len(p.tokens) for p in greedy.proposals.values())
    for r in replayed:
        assert (r.error, r.divergence) == (None, None)
        assert r.ids == greedy.path and r.rounds >= 1
    assert len(log.rounds) >= 1 and log.tokens
    for r in sampled:
        assert (r.error, r.divergence) == (None, None)
        assert r.ids == log.tokens and r.rounds == len(log.rounds)
    for r in alone:
        assert r.error is None and r.ids == greedy.path
