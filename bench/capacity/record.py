"""Recorder: the default drafter's real drafts, against a real edge-server, into the recording cache.

    python -m specdec.bench.capacity.record --edge HOST:PORT --jobs JOBS.json

(:func:`run_recorder` starts it and waits for it.)

Loads the drafter once (as device-client would: factory.choose_drafter), then for each job
``{"prompt", "temperature", "seed", "max_new_tokens", "out"}``:

* T = 0: one real session (device/client.generate with a DraftSession) gives the target's greedy
  path (greedy identity); then the drafter walks that path and proposes a round of L tokens at every
  start position, each step timed, the KV cache rolled back to the position first, as a session's
  cache is after a verdict; twice, keeping each step's faster time. Saved as a PositionTable.
* T > 0: one real session with the job's seed, every round logged as sent (SessionLog).

Prints one JSON line per job written. Run with OMP_NUM_THREADS=1: one torch thread, a device's own core.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.common import wire
from specdec.common.modeling import encode_prompt, load_model, vocab_fingerprint
from specdec.common.runtime import run_async
from specdec.device.client import generate
from specdec.device.parts import Observer, SessionParts
from specdec.device.session import DraftSession
from specdec.device.factory import choose_drafter, connection_policy, edge_channel
from specdec.bench.harness.driver import device_config, emit
from specdec.testbed import procs

from specdec.bench.capacity.recording import LoggedRound, PositionTable, Proposal, SessionLog, save


class RoundLog(Observer):
    """Keeps every drafted round a session sent, its drafting time and the verdict (a listener of its
    round events too: ``committed``)."""

    def __init__(self):
        self.logged: list[LoggedRound] = []
        self._sent: tuple | None = None  # the drafted round in flight: its message, drafting time, start

    def sent(self, rd) -> None:
        self._sent = (wire.draft_to_pb(rd.block).SerializeToString(), rd.draft_seconds + rd.encode_seconds,
                      bool(rd.drafted_ahead), time.perf_counter())

    def committed(self, event) -> None:
        if self._sent is None:
            return  # an edge-only round: nothing drafted
        (draft, draft_s, ahead, sent_at), self._sent = self._sent, None
        self.logged.append(LoggedRound(draft=draft, draft_s=draft_s, drafted_ahead=ahead,
                                       num_accepted=int(event.record.accepted), next_token=int(event.new_tokens[-1]),
                                       wait_s=time.perf_counter() - sent_at))


class StepTimes(Observer):
    """Times each drafting step (forward, sampling, encoding)."""

    def __init__(self):
        self.step_s: list[float] = []

    def step(self, seconds: float) -> None:
        self.step_s.append(seconds)


WALK_PASSES = 2  # each position drafted this many times; its step times are the fastest pass's,
# so that a burst of other work on the shared host does not go into the recording for good


def walk(drafter, hello, prompt_ids: list[int], path: list[int]) -> dict[int, Proposal]:
    """The drafter's round at every start position along ``path`` (key: tokens generated so far)."""
    passes = [walk_once(drafter, hello, prompt_ids, path) for _ in range(WALK_PASSES)]
    out = passes[0]
    for other in passes[1:]:
        for i, p in other.items():
            if p.tokens != out[i].tokens or p.payloads != out[i].payloads:
                raise RuntimeError(f"the drafter proposed differently at position {i} in two passes")
            out[i].step_s = [min(a, b) for a, b in zip(out[i].step_s, p.step_s)]
    return out


def walk_once(drafter, hello, prompt_ids: list[int], path: list[int]) -> dict[int, Proposal]:
    timer = StepTimes()
    sess = DraftSession(drafter, hello, draft_ahead=False, parts=SessionParts(observer=timer))
    sess.start(prompt_ids)
    seq = list(prompt_ids) + list(path)
    out = {}
    for i in range(len(path)):
        s = len(prompt_ids) + i
        sess.tokens = seq[:s]
        sess.model.truncate(min(sess.model.cache_len, s - 1))  # a verified position's cache, as after a verdict
        sess.round_id, timer.step_s = 0, []
        rd = sess.draft(sess.plan(), hello.draft.draft_len)
        out[i] = Proposal(list(rd.block.token_ids), list(rd.block.distributions), list(timer.step_s))
    return out


async def record_job(channel, drafter, choice, edge: str, job: dict) -> dict:
    cfg = device_config(edge, {"temperature": job["temperature"], "max_new_tokens": job["max_new_tokens"]})
    prompt_ids = encode_prompt(drafter.tokenizer, job["prompt"], raw=cfg.raw)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=job["seed"],
                      operating_point=choice.operating_point)
    log = RoundLog()
    session = DraftSession(drafter, hello, draft_ahead=cfg.draft_ahead, parts=SessionParts(observer=log))
    session.listeners.append(log.committed)
    t0 = time.perf_counter()
    r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids, timeout=cfg.timeout,
                       policy=connection_policy(cfg))
    meta = {"drafter": drafter.name, "edge_model": r.welcome.model_name, "session_wall_s": r.wall_seconds,
            "session_tokens": len(r.token_ids), "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    common = dict(prompt=job["prompt"], prompt_ids=prompt_ids, hello=wire.hello_to_pb(hello).SerializeToString(),
                  eos_ids=list(drafter.eos_token_ids), max_new_tokens=job["max_new_tokens"], meta=meta)
    if job["temperature"] == 0:
        proposals = await asyncio.to_thread(walk, drafter, hello, prompt_ids, r.token_ids)
        rec = PositionTable(path=list(r.token_ids), proposals=proposals, **common)
    else:
        rec = SessionLog(seed=job["seed"], temperature=job["temperature"], tokens=list(r.token_ids),
                         rounds=log.logged, **common)
    save(rec, Path(job["out"]))
    return {"recorded": job["out"], "tokens": len(r.token_ids), "seconds": time.perf_counter() - t0}


async def main_async(args) -> None:
    jobs = json.loads(Path(args.jobs).read_text())
    base = device_config(args.edge, {})
    choice = choose_drafter(base)
    drafter = await asyncio.to_thread(load_model, choice.spec)
    emit({"ready": True, "draft_model": drafter.name})
    async with edge_channel(base) as channel:
        for job in jobs:
            emit(await record_job(channel, drafter, choice, args.edge, job))


RECORDER = "specdec.bench.capacity.record"
RECORD_TIMEOUT_S = 3600.0


def run_recorder(address: str, jobs: list[dict], log: Path, on_line) -> None:
    """Run the recorder over ``jobs`` in a process of its own (one torch thread, as a device has its
    own core), ``on_line`` seeing each line it prints; raises if it fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", RECORDER, "--edge", address, "--jobs", f.name],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=procs.child_env())
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                on_line(json.loads(line))
        if proc.wait(timeout=RECORD_TIMEOUT_S):
            raise RuntimeError(f"recorder failed ({proc.returncode}); see {log}")
    Path(f.name).unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge", required=True)
    p.add_argument("--jobs", required=True, help="JSON list of jobs")
    run_async(main_async(p.parse_args()))  # torch's threads: OMP_NUM_THREADS (1, from the rig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
