"""The load generator: many replayed devices in one asyncio process, each a thin gRPC client speaking
the device's protocol (Hello, Prompt, Draft rounds, Verdicts, Close) through specdec.common.wire.

A client sleeps the recorded drafting time instead of drafting (scripts.py), so 32 of them cost a
few milliseconds of CPU per round, and the edge sees what 32 real devices with their own CPUs would
send it, when they would send it.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.device.factory import DeviceConfig, open_channel

from specdec.bench.capacity.scripts import Divergence

SESSION_TIMEOUT_S = 600.0   # one session longer than this is a failure of the run, not a data point
CLOSE_GRACE_S = 5.0


@dataclass
class SessionResult:
    client: int
    index: int                       # the client's n-th session
    kind: str                        # replay / edge-only
    t_hello: float = 0.0             # perf_counter when Hello was sent
    t_start: float = 0.0             # after Welcome, when the Prompt went out (the device's wall clock starts)
    events: list[tuple[float, int]] = field(default_factory=list)   # (perf_counter, tokens) per verdict
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    hints: list[int | None] = field(default_factory=list)   # the edge's draft-length advice before each round
    hints_not_followed: int = 0      # T > 0 replays: rounds longer than the advice (scripts.SessionScript)
    ids: list[int] = field(default_factory=list)   # the tokens delivered (not written to the results)
    edge_s: float = 0.0              # the edge's own verify + decode seconds, from the verdicts (as the device counts)
    divergence: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def t_end(self) -> float:
        return self.events[-1][0] if self.events else self.t_start

    def to_json(self, t0: float) -> dict:
        tok = self.tokens
        wall = self.t_end - self.t_start
        ttft = next((t for t, n in self.events if n), None)
        return {"client": self.client, "index": self.index, "kind": self.kind, "tokens": tok,
                "t_hello": self.t_hello - t0, "t_start": self.t_start - t0, "t_end": self.t_end - t0,
                "wall_s": wall, "tokens_per_s": tok / wall if wall > 0 and tok else 0.0,
                "ttft_s": (ttft - self.t_hello) if ttft is not None else None,
                "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "hints": self.hints, "hints_not_followed": self.hints_not_followed, "edge_s": self.edge_s, "divergence": self.divergence, "error": self.error,
                "events": [(round(t - t0, 5), n) for t, n in self.events]}


def edge_only_hello(h: P.Hello, operating_point=()) -> P.Hello:
    """The Hello device-client --mode none sends for a session like ``h`` (same seed, temperature)."""
    cfg = DeviceConfig.of(mode="none", temperature=h.temperature, max_new_tokens=h.max_new_tokens)
    return cfg.hello(h.vocab_fingerprint, h.vocab_size, seed=h.seed, operating_point=operating_point)


async def _read(call):
    msg = await call.read()
    if msg is grpc.aio.EOF:
        raise RuntimeError(f"edge closed the stream: {await call.code()} {await call.details()}")
    return msg


async def run_session(stub, script, res: SessionResult) -> SessionResult:
    """One session driven by ``script`` (scripts.py) over a new stream of ``stub``."""
    call = stub.Generate()
    try:
        res.t_hello = time.perf_counter()
        await call.write(wire.hello_to_pb(script.hello))
        welcome = wire.edge_message_from_pb(await _read(call))
        if not isinstance(welcome, P.Welcome):
            raise RuntimeError("expected Welcome")
        res.t_start = time.perf_counter()
        await call.write(wire.prompt_to_pb(P.Prompt(tuple(script.prompt_ids))))
        hint = None  # load-aware speculation (issue 19 item 2): the newest advice of any verdict counts
        while not script.finished:
            res.hints.append(hint)
            plan = script.next_round(hint)
            if plan.delay_s > 0:
                await asyncio.sleep(plan.delay_s)
            t_send = time.perf_counter()
            await call.write(wire.draft_to_pb(plan.block))
            res.rounds += 1
            res.drafted += len(plan.block.token_ids)
            while True:
                msg = await _read(call)
                verdict = wire.edge_message_from_pb(msg)
                if not isinstance(verdict, P.Verdict):
                    raise RuntimeError("expected Verdict")
                new = script.on_verdict(plan, verdict, time.perf_counter() - t_send)
                res.edge_s += verdict.verify_seconds + verdict.decode_seconds
                res.events.append((time.perf_counter(), len(new)))
                res.ids.extend(new)
                if getattr(verdict, "draft_len_hint", None) is not None:
                    hint = verdict.draft_len_hint
                if not verdict.more:
                    break
            res.accepted += verdict.num_accepted
        await call.write(wire.close_to_pb())
        await call.done_writing()
        await asyncio.wait_for(call.code(), CLOSE_GRACE_S)
        res.hints_not_followed = getattr(script, "hints_not_followed", 0)
    except Divergence as exc:
        res.divergence = str(exc)
        await _close_quietly(call)
    except Exception as exc:  # one failed session is reported, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        call.cancel()
    return res


async def _close_quietly(call) -> None:
    try:
        await call.write(wire.close_to_pb())
        await call.done_writing()
        await asyncio.wait_for(call.code(), CLOSE_GRACE_S)
    except Exception:
        pass


async def run_client(address: str, client: int, scripts, kind: str) -> list[SessionResult]:
    """One device: its sessions back to back on its own channel."""
    out = []
    async with open_channel(address) as channel:
        stub = pb_grpc.SpeculativeDecodingStub(channel)
        for i, make in enumerate(scripts):
            res = SessionResult(client, i, kind)
            try:
                out.append(await asyncio.wait_for(run_session(stub, make(), res), SESSION_TIMEOUT_S))
            except asyncio.TimeoutError:
                res.error = f"session longer than {SESSION_TIMEOUT_S:g} s"
                out.append(res)
    return out


async def run_cell(address: str, clients: list[list], kind: str) -> tuple[float, list[SessionResult]]:
    """N clients at once (``clients[i]``: script factories of client i); (t0, every session's result)."""
    t0 = time.perf_counter()
    got = await asyncio.gather(*(run_client(address, i, s, kind) for i, s in enumerate(clients)))
    return t0, [r for rs in got for r in rs]
