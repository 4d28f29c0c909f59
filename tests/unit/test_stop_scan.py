"""The edge's scan for the device's end-of-sequence ids (edge/verifier.StopScan): the answer a scan of
the whole generated sequence gives, each token looked at once; and when a session is complete."""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.common.codecs import encode_dssd_scalars
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.modes import Mode
from specdec.common.protocol import DraftBlock, Prompt, ResidualRequest
from specdec.edge.server import target_info
from specdec.edge.verifier import EdgeLimits, StopScan, VerifierSession, complete
from tests.support.harness import device_config, load
from tests.support.laws import PROMPT


def test_the_scan_answers_as_a_whole_scan_and_looks_at_each_token_once() -> None:
    looked: list[int] = []

    class Counted(list):
        def __getitem__(self, i):
            looked.append(i)
            return super().__getitem__(i)

    scan, tokens = StopScan((9, 7)), Counted([7, 1, 2])  # the prompt (from 2 on: generated) may hold one
    assert not scan.reached(tokens, 2)
    tokens += [3, 4]
    assert not scan.reached(tokens, 2)
    tokens.append(9)
    assert scan.reached(tokens, 2) and scan.reached(tokens, 2)
    assert looked == [2, 3, 4, 5, 5]  # the hit is looked at again, nothing before it
    resynced = [7, 1, 2, 3]  # a resync replaces the list: scanned afresh
    assert not scan.reached(resynced, 2) and scan.reached(resynced + [7], 2)
    assert not StopScan(()).reached([9, 7], 0)  # no stop ids: never


def test_a_session_waiting_for_its_dssd_correction_is_not_complete_at_an_accepted_end_of_sequence(tiny_pair_v8) -> None:
    """A DSSD round that drafted on past an end-of-sequence token: the token accepted, the next draft
    rejected. The device still draws the correction (from the residual, if its samples fail), so the
    edge must serve that round trip, not end the session as complete at the accepted token."""
    target = load(str(tiny_pair_v8[0]))
    tokenizer = load(str(tiny_pair_v8[1])).tokenizer
    prompt = encode_prompt(tokenizer, PROMPT, raw=True)
    # target top-1: p one-hot, so the argmax draft is accepted and any other is rejected, surely
    cfg = device_config(temperature=1.0, max_new_tokens=8, draft_len=2, mode=Mode.DSSD, dssd_samples=1,
                        target_top_k=1)
    with torch.inference_mode():
        first = int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())
        second = int(target.model(torch.tensor([prompt + [first]])).logits[0, -1].argmax())
    hello = replace(cfg.hello(vocab_fingerprint(tokenizer), target.vocab_size, seed=0),
                    stop_ids=(first,))  # the accepted draft ends the text on the device
    edge = VerifierSession(target, target_info(target), hello, EdgeLimits(), "s")
    edge.prefill(Prompt(tuple(prompt)))
    rejected = (second + 1) % target.vocab_size
    verdict = edge.verify(DraftBlock(1, (first, rejected), dssd_scalars=encode_dssd_scalars(
        torch.tensor([0.5, 1.0], dtype=torch.float64))))
    assert verdict.num_accepted == 1 and verdict.next_token is None  # a DSSD rejection after the stop id
    assert not complete(edge)
    assert edge.residual(ResidualRequest(1)).round_id == 1  # the fallback the device may ask for
