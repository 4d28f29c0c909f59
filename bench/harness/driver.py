"""The device driver every benchmark runs: one process that loads the default drafter once and runs
many sessions.

Runs where the device runs (inside the testbed's device namespace, or on loopback), against a real
``edge-server`` process, through the same pieces as ``device-client --json``: ``DeviceConfig`` ->
``factory.new_session`` (``mode auto``'s controller where asked) -> ``client.generate`` ->
``runner.result_json``. Starting one ``device-client`` per session would spend ~15-40 s importing
torch and loading the drafter on these shared cores; this loads it once per run and keeps one
channel to the edge. Its sessions share one ``mode auto`` memory of the link and the models, as
device-client's and the daemon's do, so it carries over from one link to the next like a device
that moves between links.

    python -m specdec.bench.harness.driver --edge HOST:PORT < batches

It loads the drafter, warms up with one short session, prints ``{"ready": ...}``, then reads one
batch per stdin line, ``{"jobs": [...]}``, runs it and prints ``{"batch_done": true}``; the
benchmark changes the link between batches. An empty line or ``{"quit": true}`` ends it. Jobs are
``{"id", "config": {DeviceConfig fields and draft settings}, "prompts": [...], "seeds": [...],
"budget_s": seconds, "extras": [...], "topk_grid": [...] | null, "fresh_tracker": bool}`` (the last:
mode auto forgets what earlier jobs taught it). Prints one JSON line per session
(``{"job", "prompt", "seed", "record", "extra"}``), one per job end (``{"job", "done", ...}``) and
``{"error": ...}`` lines for sessions that failed. ``extra`` holds what the CLI does not print, as the
job's ``extras`` ask:

- ``"distributions"``: per-round (positions, accepted) pairs, the truncated mass sigma and support
  size of every encoded distribution, each round's uplink bytes, and, with a ``topk_grid``, the
  drafter's top-K mass at each K for every drafted distribution;
- ``"timeline"``: one entry per round, ``{"t_wall", "mode", "top_k", "draft_len", "generated",
  "accepted", "positions", "uplink_bytes"}`` (under mode auto also ``"auto"``: the choice, why, and the
  safety net's estimates of both arms) with the round's end as ``time.time()`` (the benchmark
  changes the link on the same clock, so the two line up without guessing at pipe latency), for
  edge-only rounds ``token_t`` (each streamed token's arrival), the session's wall start and end
  (``session_t0``, ``session_t1``), and ``device_cpu_s``: the CPU seconds this process (all its
  threads) used meanwhile, the device's share of cores it may share with the edge (bench-traces runs
  one session at a time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import fields, replace
from functools import partial

import torch

from specdec.bench.harness.plan import DRAFT_DELAY
from specdec.common.modeling import encode_prompt, load_model, vocab_fingerprint
from specdec.common.runtime import run_async
from specdec.common.modes import Mode
from specdec.common.settings import setting_names
from specdec.device import factory, runner
from specdec.device.auto import AutoConfig, LinkTracker
from specdec.device.client import generate
from specdec.common.grammar import Grammar, GrammarKind
from specdec.device.factory import DeviceConfig
from specdec.device.parts import Observer, SessionParts
from specdec.device.session import DraftSession

WARMUP_TOKENS = 8  # one short untimed session first: allocators, caches and the channel warm up
# A job's config key: AutoConfig fields for mode auto (e.g. {"gumbel": false}); each distinct one has
# its own memory of the link, as another device would.
AUTO_CONFIG = "auto_config"


class Recording(Observer):
    """Logs each round and each encoded distribution of a fixed-settings session (read-only).

    With drafting ahead, positions are encoded in a worker thread before their round is sent, and a
    round drafted on a wrong guess is thrown away: each encoding's entry travels with its round
    (:meth:`measure`) and is logged only when the round that holds it is sent, so the logs describe
    exactly the distributions the edge received.
    """

    def __init__(self, topk_grid=None):
        self.rounds_log: list[tuple[int, int]] = []   # (draft positions, accepted) per round
        self.sigma: list[float] = []                  # dropped mass of each encoded q (TSLT Thm. 1)
        self.support: list[int] = []                  # transmitted support size K of each encoded q
        self.topk_grid = list(topk_grid or [])
        self.topk_mass: list[list[float]] = []        # [steps][len(grid)] mass of the drafter's top-K

    def measure(self, q, encoded, settings):
        """Kept with the position's round, so only the positions of rounds sent are logged (not those
        drafted ahead on a wrong guess, nor past a bit budget)."""
        if settings.mode in (Mode.DSSD, Mode.GUMBEL):
            return None  # DSSD and gumbel send no distribution: nothing to log
        return encoded.support_size, encoded.dropped_mass, self._topk_masses(q)

    def _topk_masses(self, q) -> list[float]:
        if not self.topk_grid:
            return []
        cum = q.double().sort(descending=True).values.cumsum(0)  # [V]; K beyond V means K = V
        return [min(1.0, float(cum[min(k, cum.numel()) - 1])) for k in self.topk_grid]

    def sent(self, rd) -> None:
        for entry in rd.q_stats:
            if entry is not None:
                support, sigma, masses = entry
                self.support.append(support)
                self.sigma.append(sigma)
                if masses:
                    self.topk_mass.append(masses)

    def committed(self, event) -> None:
        """A listener of the session's round events."""
        self.rounds_log.append((event.record.positions, event.record.accepted))


def recording_session(drafter, hello, topk_grid=None, *, policy=None, parts=SessionParts(), **kw) -> DraftSession:
    """A session whose observer is a :class:`Recording` (``session.parts.observer``). Fixed settings
    only: mode auto measures the encoded q's itself, and the observer would see none."""
    assert policy is None, "a Recording records fixed-settings sessions"
    recording = Recording(topk_grid)
    session = DraftSession(drafter, hello, parts=replace(parts, observer=recording), **kw)
    session.listeners.append(recording.committed)
    return session


def device_config(edge: str, overrides: dict) -> DeviceConfig:
    """A job's config: DeviceConfig fields and draft settings (checked by the settings table) by name
    (``auto_config``, mode auto's candidates, and ``draft_delay_s`` are the driver's:
    :meth:`Device.tracker_for`, :class:`DraftDelay`)."""
    overrides = {k: v for k, v in overrides.items() if k not in (AUTO_CONFIG, DRAFT_DELAY)}
    names = {f.name for f in fields(DeviceConfig)} | set(setting_names())
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown DeviceConfig fields or draft settings {sorted(unknown)}")
    kw = dict(overrides)
    if "tree" in kw:
        kw["tree"] = tuple(kw["tree"])
    if isinstance(kw.get("grammar"), dict):  # JSON {"kind", "source"}: the target law's grammar
        kw["grammar"] = Grammar(GrammarKind(kw["grammar"]["kind"]), kw["grammar"].get("source", ""))
    cfg = DeviceConfig.of(**{k: v for k, v in kw.items() if k not in setting_names()}, edge=edge, json=True)
    return cfg.with_draft(**{k: v for k, v in kw.items() if k in setting_names()})


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# What a timeline keeps of mode auto's choice of each round (auto.py's _explain): enough to see why a
# session kept drafting or streaming, and which estimate behind the model's prices was off, without
# the whole round log.
AUTO_TIMELINE_KEYS = ("choice", "why", "predicted_tokens_per_s", "net_edge_tokens_per_s", "net_spec_tokens_per_s",
                      "rtt_s", "draft_s", "verify_base_s", "verify_per_token_s", "edge_token_s", "alpha_base",
                      "time_scale", "model_edge_tokens_per_s", "model_spec_tokens_per_s", "probe_due_s",
                      "spec_lost", "edge_lost", "spec_probe_cost_s", "edge_probe_cost_s", "guess_rate", "spec_pays",
                      "retime", "spec_ceiling_tokens_per_s", "time_scales", "encode_s", "uplink_bps", "downlink_bps",
                      "shadow", "catch_up")


def add_timeline(session) -> list[dict]:
    """Log each round of ``session`` with its end time (a listener of its round events, and the time
    each edge-only token arrived), whatever session the device runs."""
    timeline: list[dict] = []
    take = session.take_edge_token
    tokens: list[float] = []

    def on_round(event) -> None:
        record, s = event.record, event.settings
        mode = record.mode
        entry = {"t_wall": time.time(), "mode": mode, "generated": record.generated, "accepted": record.accepted,
                 "positions": record.positions,
                 "top_k": s.top_k if mode in ("tslt", "ksqs") else 0,
                 "draft_len": 0 if mode == "none" else s.draft_len,
                 "uplink_bytes": record.uplink_bytes}
        if mode == "none":
            entry["token_t"] = tokens[-record.generated:] if record.generated else []
            if record.shadow_fed:  # what the shadow's forwards cost (mode auto weighs it)
                entry["shadow_s"], entry["shadow_fed"] = record.shadow_s, record.shadow_fed
        choice = event.plan.choice
        if choice:  # mode auto: why this round, and the safety net's two arms as it saw them
            entry["auto"] = {key: choice.get(key) for key in AUTO_TIMELINE_KEYS}
        timeline.append(entry)

    def timed_take(rd, verdict):
        token = take(rd, verdict)
        tokens.append(time.time())
        return token

    session.listeners.append(on_round)
    session.take_edge_token = timed_take
    return timeline


async def run_session(channel, drafter, cfg: DeviceConfig, prompt: str, seed: int, topk_grid=None,
                      operating_point=(), *, extras=("distributions",), tracker: LinkTracker | None = None
                      ) -> tuple[dict, dict]:
    """One session as device-client runs it: its JSON record and the ``extras`` asked for."""
    t0, cpu0 = time.time(), time.process_time()
    prompt_ids = encode_prompt(drafter.tokenizer, prompt, raw=cfg.raw)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=seed,
                      operating_point=operating_point)
    recording = "distributions" in extras
    session_class = partial(recording_session, topk_grid=topk_grid) if recording else DraftSession
    session = factory.new_session(cfg, drafter, hello, tracker, session_class=session_class)
    timeline = add_timeline(session) if "timeline" in extras else None
    r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids, timeout=cfg.timeout,
                       policy=factory.connection_policy(cfg))
    record = runner.result_json(hello.draft, drafter, session, r)
    record.pop("token_ids", None)
    record["prompt_tokens"] = len(prompt_ids)
    extra = {}
    if recording:
        log = session.parts.observer
        extra.update(rounds=log.rounds_log, sigma=log.sigma, support=log.support,
                     topk_mass=log.topk_mass, round_uplink_bytes=list(r.round_uplink_bytes))
    if timeline is not None:
        extra.update(timeline=timeline, session_t0=t0, session_t1=time.time(),
                     device_cpu_s=time.process_time() - cpu0)
    return record, extra


class DraftDelay:
    """A sleep of ``seconds`` after each forward of the drafter's module: a slower device (the job's
    ``draft_delay_s``). Sleeping, not computing, so that the cores the edge shares here stay its own."""

    def __init__(self, module: torch.nn.Module):
        self.seconds = 0.0
        module.register_forward_hook(self._after)

    def _after(self, module, args, output) -> None:
        if self.seconds > 0:
            time.sleep(self.seconds)


class Device:
    """The drafter, the channel to the edge and ``mode auto``'s memory of the link, for all sessions."""

    def __init__(self, channel, drafter, edge: str, operating_point=()):
        self.channel, self.drafter, self.edge, self.operating_point = channel, drafter, edge, operating_point
        self.delay = DraftDelay(drafter.model)
        self.tracker = LinkTracker()
        self.trackers: dict[str, LinkTracker] = {}  # per job AUTO_CONFIG

    def tracker_for(self, auto_config: dict | None) -> LinkTracker:
        if not auto_config:
            return self.tracker
        key = json.dumps(auto_config, sort_keys=True)
        if key not in self.trackers:
            self.trackers[key] = LinkTracker(AutoConfig(**auto_config))
        return self.trackers[key]

    async def session(self, cfg: DeviceConfig, prompt: str, seed: int, extras=(), topk_grid=None,
                      tracker: LinkTracker | None = None) -> tuple[dict, dict]:
        return await run_session(self.channel, self.drafter, cfg, prompt, seed, topk_grid, self.operating_point,
                                 extras=extras, tracker=tracker or self.tracker)

    async def run_jobs(self, jobs: list[dict]) -> None:
        for job in jobs:
            if job.get("fresh_tracker"):
                self.tracker = LinkTracker()  # mode auto starts this job knowing nothing of the link
            cfg = device_config(self.edge, job["config"])
            self.delay.seconds = float(job["config"].get(DRAFT_DELAY, 0.0))
            tracker = self.tracker_for(job["config"].get(AUTO_CONFIG))
            extras, grid = job.get("extras", ()), job.get("topk_grid")
            await run_job(job, lambda prompt, seed: self.session(cfg, prompt, seed, extras, grid, tracker))


async def run_job(job: dict, session) -> None:
    """A job's sessions, ``await session(prompt, seed)`` -> (record, extra) each, within its time
    budget: one JSON line per session (or its error), then one for the job."""
    t0 = time.perf_counter()
    ran = 0
    for i, (prompt, seed) in enumerate(zip(job["prompts"], job["seeds"])):
        if ran and time.perf_counter() - t0 > job.get("budget_s", float("inf")):
            break  # this point's time is spent; at least one session always runs
        try:
            record, extra = await session(prompt, seed)
        except Exception as exc:  # one failed session must not sink the run: report it
            emit({"job": job["id"], "prompt": i, "error": f"{type(exc).__name__}: {exc}"})
            continue
        ran += 1
        emit({"job": job["id"], "prompt": i, "seed": seed, "record": record, "extra": extra})
    emit({"job": job["id"], "done": True, "sessions": ran, "planned": len(job["prompts"]),
          "elapsed_s": time.perf_counter() - t0})


async def main_async(args) -> None:
    """Load the drafter, then run each batch of jobs read from stdin (one JSON line per batch)."""
    base = device_config(args.edge, {"draft_model": args.draft_model} if args.draft_model else {})
    choice = factory.choose_drafter(base)
    drafter = await asyncio.to_thread(load_model, choice.spec)
    async with factory.edge_channel(base) as channel:
        device = Device(channel, drafter, args.edge, choice.operating_point)
        if not args.no_warmup:
            warm = device_config(args.edge, {"temperature": 1.0, "max_new_tokens": WARMUP_TOKENS})
            await device.session(warm, "Hello!", 0)
        emit({"ready": True, "draft_model": drafter.name})
        await serve_batches(device.run_jobs)


async def serve_batches(run_batch) -> None:
    """Run each batch of jobs read from stdin (one JSON line ``{"jobs": [...]}`` per batch) with
    ``run_batch(jobs)``, answering ``batch_done`` after each, until EOF or ``{"quit": true}``."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line or not line.strip():
            return
        batch = json.loads(line)
        if batch.get("quit"):
            return
        await run_batch(batch["jobs"])
        emit({"batch_done": True})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--draft-model", default=None, help="drafter checkpoint (default: the default drafter)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
