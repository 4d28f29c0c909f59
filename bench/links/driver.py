"""Device side of bench-links: bench/suite/driver.py's process, with each round's wall-clock end time.

    python -m specdec.bench.links.driver --edge HOST:PORT < batches

Same protocol as bench/suite/driver.py (one ``{"jobs": [...]}`` batch per stdin line, one JSON line
per session, ``{"batch_done": true}`` after a batch). Each session line's ``extra`` carries
``timeline``: one entry per round, ``{"t_wall", "mode", "top_k", "draft_len", "generated",
"accepted", "positions"}`` with the round's end as ``time.time()`` (the benchmark changes the link
on the same clock, so the two line up without guessing at pipe latency), and for edge-only rounds
``token_t``: each streamed token's arrival time. ``session_t0`` is the wall time the session began
(before Hello). The timeline is taken by wrapping the session's ``stats.observe`` and
``take_edge_token`` on the instance, so it works for whatever session class the device uses
(``mode auto``'s controller included); the record's own ``rounds`` (``round_log``) are kept as is.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch

from specdec.common.modeling import encode_prompt, load_model, vocab_fingerprint
from specdec.common.runtime import run_async
from specdec.device import runner
from specdec.device.client import generate
from specdec.device.session import DraftSession
from specdec.bench.harness.driver import WARMUP_TOKENS, device_config, emit, run_job, serve_batches


try:  # mode auto's memory of the link and the models: one per device, shared by its sessions (as
    # device-client and the daemon keep it), so it carries over from one cell to the next like a
    # device that moves between links
    from specdec.device.auto import LinkTracker
    TRACKER = LinkTracker()
except ImportError:  # a device without mode auto yet
    TRACKER = None


def new_session(drafter, hello, cfg):
    """The session device-client would use for ``cfg`` (runner.new_session: ``mode auto``'s
    controller where asked), else a plain DraftSession (a device without mode auto)."""
    factory = getattr(runner, "new_session", None)
    if factory is not None:
        return factory(cfg, drafter, hello, TRACKER) if TRACKER is not None else factory(cfg, drafter, hello)
    return DraftSession(drafter, hello, draft_ahead=cfg.draft_ahead)


def add_timeline(session) -> list[dict]:
    """Log each round of ``session`` with its end time (instance-level wrappers, class untouched)."""
    timeline: list[dict] = []
    observe, take = session.stats.observe, session.take_edge_token
    tokens: list[float] = []

    def timed_observe(record) -> None:
        observe(record)
        s = session.settings  # still this round's: the next round's are chosen after this
        mode = record.mode
        entry = {"t_wall": time.time(), "mode": mode, "generated": record.generated, "accepted": record.accepted,
                 "positions": record.positions,
                 "top_k": s.top_k if mode in ("tslt", "ksqs") else 0,
                 "draft_len": 0 if mode == "none" else s.draft_len,
                 "uplink_bytes": record.uplink_bytes}
        if mode == "none":
            entry["token_t"] = tokens[-record.generated:] if record.generated else []
        timeline.append(entry)

    def timed_take(rd, verdict):
        token = take(rd, verdict)
        tokens.append(time.time())
        return token

    session.stats.observe = timed_observe
    session.take_edge_token = timed_take
    return timeline


async def run_session(channel, drafter, cfg, prompt: str, seed: int, operating_point=()) -> tuple[dict, dict]:
    t0 = time.time()
    prompt_ids = encode_prompt(drafter.tokenizer, prompt, raw=cfg.raw)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=seed,
                      operating_point=operating_point)
    session = new_session(drafter, hello, cfg)
    timeline = add_timeline(session)
    r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids, timeout=cfg.timeout,
                       policy=runner.connection_policy(cfg))
    record = runner.result_json(hello.draft, drafter, session, r)
    record.pop("token_ids", None)
    record["prompt_tokens"] = len(prompt_ids)
    return record, {"timeline": timeline, "session_t0": t0, "session_t1": time.time()}


async def run_jobs(channel, drafter, edge: str, jobs: list[dict], operating_point) -> None:
    for job in jobs:
        cfg = device_config(edge, job["config"])
        await run_job(job, lambda prompt, seed: run_session(channel, drafter, cfg, prompt, seed, operating_point))


async def main_async(args) -> None:
    base = device_config(args.edge, {})
    choice = runner.choose_drafter(base)
    drafter = await asyncio.to_thread(load_model, choice.spec)
    async with runner.edge_channel(base) as channel:
        warm = device_config(args.edge, {"temperature": 1.0, "max_new_tokens": WARMUP_TOKENS})
        await run_session(channel, drafter, warm, "Hello!", 0, choice.operating_point)
        emit({"ready": True, "draft_model": drafter.name})
        await serve_batches(lambda jobs: run_jobs(channel, drafter, args.edge, jobs, choice.operating_point))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
