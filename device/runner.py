"""The one-shot device run: load the drafter, open a channel, run sessions, print text or JSON."""
from __future__ import annotations

import asyncio
import json
from typing import TextIO

from prometheus_client import start_http_server

from specdec.common.modeling import LoadedModel, encode_prompt, load_model, vocab_fingerprint
from specdec.common.protocol import DraftSettings
from specdec.device.client import GenerationResult, generate
from specdec.device.detokenize import Detokenizer
from specdec.device.factory import (DeviceConfig, choose_drafter, connection_policy, device_tracker, edge_fleet,
                                    new_session, remember)
from specdec.device.metrics import DeviceMetrics
from specdec.device.session import DraftSession


def result_json(settings: DraftSettings, drafter: LoadedModel, session: DraftSession, r: GenerationResult) -> dict:
    s = session.stats
    text = drafter.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    n = len(r.token_ids)
    return {
        "token_ids": r.token_ids,
        "text": text,
        "mode": "auto" if session.policy is not None else settings.mode.value,
        "draft_model": drafter.name,
        "edge_model": r.welcome.model_name,
        "stats": {
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "draft_positions": s.draft_positions,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            # per-token acceptance alpha (the papers' i.i.d. alpha, eq. 8): accepted / positions tested
            "positions_verified": s.positions_verified,
            "token_acceptance_rate": s.token_acceptance_rate,
            "accepted_per_position": s.accepted_per_position,
            "drafted_per_position": s.drafted_per_position,
            "draft_ahead": {"rounds_used": s.ahead_rounds_used, "tokens_used": s.ahead_tokens_used,
                            "tokens_discarded": s.ahead_tokens_discarded},
            "acceptance_per_depth": s.acceptance_per_depth,
            "tree": list(settings.tree),
            "tree_nodes_sent": s.draft_tokens if settings.tree else 0,
            "generated_tokens": n,
            "uplink_bytes": r.uplink_bytes,
            "downlink_bytes": r.downlink_bytes,
            "setup_bytes": r.setup_bytes,
            "uplink_bytes_per_token": r.uplink_bytes / n if n else 0.0,
            "theoretical_uplink_bits": s.theoretical_uplink_bits,
            "dssd_fallbacks": r.dssd_fallbacks,
            "dssd_residual_trips": r.dssd_residual_trips,
            "wall_seconds": r.wall_seconds,
            "tokens_per_second": n / r.wall_seconds if r.wall_seconds > 0 else 0.0,
            "time": {"draft": s.seconds["draft"], "encode": s.seconds["encode"],
                     "network": r.network_seconds, "verify": r.verify_seconds},
            "reconnects": r.reconnects,
            "fleet": r.trail.to_json(),  # the edges it ran on, moves, and how each resume went
        },
        **({"rounds": session.round_log} if session.round_log is not None else {}),
    }


class _TextStreamer:
    """Prints verified text as it arrives (decoded incrementally: device/detokenize.py)."""

    def __init__(self, tokenizer, out: TextIO):
        self.text = Detokenizer(tokenizer)
        self.out = out

    def __call__(self, new: list[int]) -> None:
        self._write(self.text.add(new))

    def close(self) -> None:
        self._write(self.text.flush())

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


async def run_device(cfg: DeviceConfig, out: TextIO) -> list[dict]:
    """Load the drafter, run ``num_samples`` sessions, write text or JSON lines to ``out``."""
    choice = choose_drafter(cfg)
    drafter = await asyncio.to_thread(load_model, choice.spec)
    prompt_ids = encode_prompt(drafter.tokenizer, cfg.prompt, raw=cfg.raw)
    fingerprint = vocab_fingerprint(drafter.tokenizer)
    metrics = DeviceMetrics()
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=metrics.registry)
    results = []
    policy = connection_policy(cfg)
    tracker = device_tracker(cfg, drafter)  # mode auto: what this device knows of its link, across sessions
    async with edge_fleet(cfg) as fleet:
        for i in range(cfg.num_samples):
            hello = cfg.hello(fingerprint, drafter.vocab_size, seed=cfg.seed + i,
                              operating_point=choice.operating_point)
            session = new_session(cfg, drafter, hello, tracker)
            streamer = None if cfg.json else _TextStreamer(drafter.tokenizer, out)
            r = await generate(fleet, session, hello, prompt_ids, drafter.eos_token_ids,
                               on_tokens=streamer, timeout=cfg.timeout, metrics=metrics, policy=policy)
            if cfg.auto:
                await asyncio.to_thread(remember, cfg, drafter, tracker)
            record = result_json(hello.draft, drafter, session, r)
            results.append(record)
            if streamer is not None:
                streamer.close()
            out.write(json.dumps(record) + "\n" if cfg.json else "\n")
            out.flush()
    if cfg.metrics_port and cfg.linger > 0:
        # A one-shot run can end between two scrapes; stay up so the last counts get scraped.
        await asyncio.sleep(cfg.linger)
    return results
