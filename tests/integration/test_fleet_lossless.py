"""Sessions that move to another edge keep the target's exact law at T = 1 (issue 34).

Each session runs over a fleet of two routes (device/fleet.py): its own cuttable relay to edge A,
and edge B. It starts on A; after its first round the relay drops the connection and refuses new
ones, as a dead edge does, so the device's failover tries A again, finds it gone, and continues the
session on B, which re-prefills the verified prefix. In the second variant (issue 44) A dies right
after computing the first round's verdict, which the device never receives: the device retries that
round on B with the same plan and the same random numbers. The first N_TOKENS tokens of every session are
compared with the target's exact law (the tiny 8-token pair and enumeration of test_lossless_e2e).
Negative control (slow, with 1200 sessions): an edge B that draws every round of a session from one generator seeded
by the session seed, as edges before issue 16 did, fails the same test.
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from tests.support.harness import device_config, edge, load, patched, run
from tests.support.linkcut import CuttableLink
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.device.client import ConnectionPolicy, generate
from specdec.device.fleet import Fleet, Selection
from specdec.device.factory import open_channel
from specdec.device.session import DraftSession
from specdec.edge import servicer
from specdec.edge.verifier import EdgeLimits, VerifierSession
from tests.support.laws import CONCURRENCY, N_TOKENS, PROMPT, TEMPERATURE, exact_law
from tests.integration.test_resume_lossless import OneGeneratorPerSession
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

# The default run checks the law of 400 sessions moved after a verdict their dying edge computed but
# never sent; the plain move's law runs in the slow tier only, at 1200 sessions as test_resume_lossless,
# where the negative control falls far below the cut: by default a moved session's tokens are checked
# to be exactly those of its unbroken run, token for token, by test_fleet and test_fleet_proxy (T = 0 and 1).
NUM_SESSIONS = 400
NUM_SESSIONS_SLOW = 1200
DRAFT_LEN = 1        # round 1 yields at most 2 of the N_TOKENS = 3 tokens: a move after it always matters
EDGE_DOWN_S = 600.0  # edge A stays gone for the rest of the session
POLICY = ConnectionPolicy(round_timeout_s=30.0, reconnect_timeout_s=30.0, backoff_initial_s=0.02, backoff_max_s=0.2)
MIN_MOVED_FRACTION = 0.9  # sessions whose first round left work to do (EOS can end one earlier)


# seed -> cut that session's link to edge A (armed by _session, fired once by DiesAfterItsVerdict)
_LOSE_VERDICT: dict = {}
CUT_WAIT_S = 10.0


class DiesAfterItsVerdict(VerifierSession):
    """Edge A computes the round's verdict (its session advances past it), then its link dies before
    the verdict leaves: the device never receives it."""

    def verify(self, draft):
        verdict = super().verify(draft)
        cut = _LOSE_VERDICT.pop(self.hello.seed, None)
        if cut is not None:
            cut()
        return verdict


def _arm_cut_after_verdict(seed: int, link: CuttableLink) -> None:
    loop = asyncio.get_running_loop()

    def cut() -> None:  # on the edge's worker thread: the relay is the event loop's
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (link.cut(EDGE_DOWN_S), done.set()))
        done.wait(CUT_WAIT_S)
    _LOSE_VERDICT[seed] = cut


async def _session(seed, cfg, drafter, edge_a: str, edge_b: str, lose_verdict: bool = False):
    host, port = edge_a.split(":")
    link = await CuttableLink(host, int(port)).start()
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=seed)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    eos = set(drafter.eos_token_ids)
    seen = {"n": 0, "cut": False}

    if lose_verdict:
        _arm_cut_after_verdict(seed, link)

    def on_tokens(new):  # after round 1, unless the session is over: edge A dies
        seen["n"] += len(new)
        if not lose_verdict and not seen["cut"] and seen["n"] < N_TOKENS and not eos & set(new):
            link.cut(EDGE_DOWN_S)
        seen["cut"] = True
    try:
        async with Fleet([link.address, edge_b], lambda t, o: open_channel(t, o), Selection.ROUND_ROBIN) as fleet:
            fleet._turn = 0  # start on A
            r = await generate(fleet, DraftSession(drafter, hello), hello, prompt, drafter.eos_token_ids,
                               on_tokens=on_tokens, timeout=120, policy=POLICY)
    finally:
        await link.close()
    return tuple(r.token_ids), tuple(r.trail.edges)


def _run_part(seeds, pair, num_sessions: int, lose_verdict: bool = False) -> list[tuple]:
    target_dir, drafter_dir = pair
    drafter = load(str(drafter_dir))
    cfg = device_config(temperature=TEMPERATURE, max_new_tokens=N_TOKENS, draft_len=DRAFT_LEN, mode="tslt", top_k=3)

    async def main():
        # A keeps each abandoned session detached for its resume window: room for all of them
        async with edge(target_dir, limits=EdgeLimits(max_sessions=2 * num_sessions), name="a") as a, \
                edge(target_dir, name="b") as b:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(seed):
                async with gate:
                    return await _session(seed, cfg, drafter, a, b, lose_verdict)
            return await asyncio.gather(*(one(s) for s in seeds))
    return list(run(main()))


def _moved_sessions(twin, pair, n: int, patches=(), lose_verdict: bool = False):
    target_dir, drafter_dir = pair
    law = exact_law(str(target_dir), tuple(encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True)))
    if twin is None:
        with patched(patches):
            results = _run_part(range(n), pair, n, lose_verdict)
    else:
        here, there = twin.split(_run_part, range(n), pair, n, lose_verdict, patches=patches)
        results = here + there
    moved = sum(1 for _, edges in results if edges == ("a", "b"))
    # ("b",): a first stream that failed before its Welcome went straight to b (the fleet's job too)
    assert all(edges in (("a",), ("b",), ("a", "b")) for _, edges in results), Counter(e for _, e in results)
    return Counter(tokens for tokens, _ in results), law, moved


@pytest.mark.slow
def test_sessions_moved_to_another_edge_keep_the_exact_law(twin, tiny_pair_v8) -> None:
    n = NUM_SESSIONS_SLOW
    counts, law, moved = _moved_sessions(twin, tiny_pair_v8, n)
    assert moved >= MIN_MOVED_FRACTION * n, moved
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"moved sessions ({moved} of {n}): {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_sessions_whose_dying_edge_computed_a_verdict_never_received_keep_the_exact_law(twin, tiny_pair_v8) -> None:
    counts, law, moved = _moved_sessions(twin, tiny_pair_v8, NUM_SESSIONS, lose_verdict=True,
                                         patches=[(servicer, "VerifierSession", DiesAfterItsVerdict)])
    assert moved >= MIN_MOVED_FRACTION * NUM_SESSIONS, moved
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"sessions whose first verdict was lost ({moved} of {NUM_SESSIONS}): {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


@pytest.mark.slow
def test_control_an_edge_reusing_the_first_rounds_numbers_fails_it(twin, tiny_pair_v8) -> None:
    counts, law, moved = _moved_sessions(twin, tiny_pair_v8, NUM_SESSIONS_SLOW,
                                         patches=[(servicer, "VerifierSession", OneGeneratorPerSession)])
    assert moved >= MIN_MOVED_FRACTION * NUM_SESSIONS_SLOW, moved
    fit = goodness_of_fit(counts, law)
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"
