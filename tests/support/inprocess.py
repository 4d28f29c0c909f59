"""The device's real round loop (device/engine.py) against a real edge VerifierSession in this process.

No gRPC, no server: the link hands each device message straight to the edge's session and queues its
answers, with their serialized sizes. What runs is the product's own code on both sides (DraftSession,
drafting ahead, DSSD fallbacks, edge-only rounds; VerifierSession with its streams), so thousands of
seeded sessions fit in a statistical test. Faults: a link can break before a chosen message, as a cut
stream does; the driver then does what the client's resilient loop does (the device aborts the round
and resends its verified prefix; the edge re-prefills it, fresh or resynced).
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace
from typing import Callable

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.modeling import LoadedModel
from specdec.common.modes import Mode
from specdec.device.engine import deliverable, finished, run_round
from specdec.device.session import DraftSession
from specdec.edge.server import target_info
from specdec.edge.verifier import EdgeLimits, TargetInfo, VerifierSession


class Broken(Exception):
    """The stream broke (the client would reconnect and resume)."""


Hint = Callable[[P.Verdict], "int | None"]   # the edge's draft-length advice for a verdict
# Sees each verified round: (the verified prefix it started from, its Draft, the Verdict, the edge).
OnRound = Callable[[tuple, P.DraftBlock, P.Verdict, VerifierSession], None]
# Break the stream at this message? Called with ("send", device message) before it leaves and with
# ("recv", edge message) before it arrives, and the device session.
Fault = Callable[[str, object, DraftSession], bool]


def cut_the_second_verdict(direction: str, msg, device) -> bool:
    """A Fault: break the stream as the session's second verdict arrives. The device aborts the round
    and the edge takes the verified prefix again (its output included, with the prompt's length)."""
    if direction != "recv" or not isinstance(msg, P.Verdict):
        return False
    device.verdicts_seen = getattr(device, "verdicts_seen", 0) + 1
    return device.verdicts_seen == 2


class EdgeLink:
    """engine.Link straight to one VerifierSession."""

    def __init__(self, edge: VerifierSession, device: DraftSession, hint: Hint | None = None,
                 fault: Fault | None = None, on_round: OnRound | None = None):
        self.edge, self.device, self.hint, self.fault, self.on_round = edge, device, hint, fault, on_round
        self.answers: deque = deque()

    async def send(self, msg) -> int:
        if self.fault is not None and self.fault("send", msg, self.device):
            raise Broken()
        if isinstance(msg, P.ResidualRequest):
            reply = self.edge.residual(msg)
            self.answers.append((reply, wire.residual_to_pb(reply).ByteSize()))
        elif self.edge.round_settings(msg).mode is Mode.NONE:
            self.answers.extend(self._sized(v) for v in self.edge.generate(msg))
        else:
            prefix = tuple(self.device.tokens)  # the verified prefix, any DSSD correction included
            verdict = self.edge.verify(msg)
            if self.on_round is not None:
                self.on_round(prefix, msg, verdict, self.edge)
            self.answers.append(self._sized(verdict))
        return wire.device_message_to_pb(msg).ByteSize()

    def _sized(self, verdict: P.Verdict) -> tuple[P.Verdict, int]:
        if self.hint is not None:
            verdict = replace(verdict, draft_len_hint=self.hint(verdict))
        return verdict, wire.verdict_to_pb(verdict).ByteSize()

    async def close(self) -> int:
        """The session's Close: the in-process edge keeps the session (a law test may go on with it)."""
        return wire.close_to_pb().ByteSize()

    async def recv(self):
        answer = self.answers.popleft()
        if self.fault is not None and self.fault("recv", answer[0], self.device):
            raise Broken()
        return answer


# What the edge states about its target, once per loaded target as the server does at startup (the
# fingerprint reads every weight tensor: per session it would cost a few percent of a law test).
_TARGET_INFO: dict[int, tuple[LoadedModel, TargetInfo]] = {}


def _target_info(target: LoadedModel) -> TargetInfo:
    known = _TARGET_INFO.get(id(target))
    if known is None or known[0] is not target:
        known = _TARGET_INFO[id(target)] = (target, target_info(target))
    return known[1]


def new_edge(target: LoadedModel, hello: P.Hello, prefix: list[int], edge_cls=VerifierSession,
             prompt_len: int = 0) -> VerifierSession:
    """An edge session given ``prefix`` (its first ``prompt_len`` tokens the prompt; 0: all), as the
    client's Prompt message gives it."""
    edge = edge_cls(target, _target_info(target), hello, EdgeLimits(), "in-process")
    edge.prefill(P.Prompt(tuple(prefix), prompt_len))
    return edge


async def generate(target: LoadedModel, device: DraftSession, prompt_ids: list[int], max_new: int,
                   hint: Hint | None = None, fault: Fault | None = None, resync: bool = False,
                   edge_cls=VerifierSession, on_round: OnRound | None = None) -> list[int]:
    """One session to ``max_new`` tokens or EOS. On a broken link the device aborts its round and the
    edge takes the verified prefix again: a fresh ``edge_cls`` session (an edge that lost the
    session), or with ``resync`` the same one (a resume that finds its KV). Returns the delivered
    tokens."""
    eos = tuple(target.eos_token_ids)
    device.start(prompt_ids)
    edge = new_edge(target, device.hello, prompt_ids, edge_cls)
    out: list[int] = []

    def deliver(new: list[int]) -> None:
        out.extend(deliverable(out, new, max_new, eos))

    while not finished(out, max_new, eos):
        link = EdgeLink(edge, device, hint, fault, on_round)
        try:
            while not finished(out, max_new, eos):
                await run_round(link, device, max_new - len(out), deliver)
        except Broken:
            await asyncio.to_thread(device.abort_round)
            if resync:
                edge.resync(P.Prompt(tuple(device.tokens), len(prompt_ids)))
            else:
                edge = new_edge(target, device.hello, device.tokens, edge_cls, len(prompt_ids))
    return out


def run_seeds(target: LoadedModel, drafter: LoadedModel, hello: P.Hello, prompt_ids: list[int], max_new: int,
              seeds, session_factory=DraftSession, **kw) -> list[tuple[list[int], DraftSession]]:
    """One session per seed (Hello's seed replaced), in order: [(tokens, session)]."""
    async def main():
        out = []
        for seed in seeds:
            device = session_factory(drafter, replace(hello, seed=seed))
            out.append((await generate(target, device, prompt_ids, max_new, **kw), device))
        return out
    return asyncio.run(main())
