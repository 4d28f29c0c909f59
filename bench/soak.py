"""Soak benchmark: 32 concurrent device sessions against an edge-server subprocess for minutes.

Each of ``--sessions`` slots runs sessions back to back (a new one starts when one ends) on its own
channel, with the real device client (``device.client.generate`` + ``device.session.DraftSession``)
on one event loop; drafter forwards run in threads and share one drafter model. Modes rotate over
all five codecs, sampled at temperature 1 with a fresh seed and prompt per session. The default
models are tiny (testbed/tiny_models.py): a 4-layer target and a drafter close to it (DRAFT_NOISE).

Recorded into ``results/soak.json`` (+ ``results/soak.csv``, one row per second):
  * throughput: generated tokens per second over time, and its mean over the steady window
    (``--duration`` seconds with every slot busy; the slots then finish their last session);
  * round latency on the device: from writing a Draft to reading its Verdict, p50 / p99;
  * the edge's resident memory (VmRSS from /proc/<pid>/status) every second: a cold baseline after
    start-up, a warmed baseline after a first short burst of sessions (the allocators, caches and
    thread pools a running server keeps), during the run, and for ``--cooldown`` seconds after the
    last session ended; plus the edge's own count of open sessions at the end.

Memory is "back to baseline" when the median RSS over the last RSS_WINDOW_S seconds of the
cooldown is at most the warmed baseline plus RSS_TOLERANCE (the larger of RSS_TOLERANCE_MIB and
RSS_TOLERANCE_FRACTION of the warmed baseline); the edge must also report zero open sessions.

    .venv/bin/python -m specdec.bench.soak [--duration 180] [--sessions 32] [--target DIR --draft DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from specdec.common.modes import Mode
from specdec.common.modeling import ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.device.client import EdgeError, generate
from specdec.device.session import DraftSession
from specdec.device.factory import DeviceConfig, open_channel

from specdec.bench.harness.rig import Edge

VOCAB_SIZE = 512                  # word-level vocabulary of testbed/tiny_models.py
# Tiny models, but a target whose KV cache is big enough to see in RSS: 4 layers x 2 KV heads x
# 64 dims x (K, V) x fp32 = 4 KiB per token, ~0.4 MiB per 100-token session, ~13 MiB for 32.
TARGET_SHAPE = dict(hidden=256, layers=4, max_positions=512)
# The drafter: the target with every weight perturbed by DRAFT_NOISE x its std
# (testbed/tiny_models.make_close_drafter). Drafts are then accepted in part (sum min(p, q) ~ 0.6 per
# token), so rounds commit several tokens and roll both KV caches back, as with a real distilled
# drafter; an unrelated random drafter (or this one at noise 0.2, or cut to 2 layers) is almost
# never right and every round would commit one token.
DRAFT_NOISE = 0.02
MODE_SETTINGS = {Mode.DENSE: {"dense_dtype": "fp16"}, Mode.TSLT: {"top_k": 16},
                 Mode.KSQS: {"top_k": 16, "lattice": 64},
                 Mode.CSQS: {"csqs_beta0": 0.01, "lattice": 64, "max_k": 64},
                 Mode.DSSD: {"dssd_samples": 2}, Mode.NONE: {}, Mode.GUMBEL: {}}
PROMPT_WORDS = (4, 16)            # prompt length range, words of the tiny vocabulary
SESSION_TIMEOUT_S = 300.0         # one session longer than this is a failure, not a soak
RSS_PERIOD_S = 1.0                # RSS sampling period
RSS_WINDOW_S = 5.0                # medians over this many seconds of samples (baselines, final)
IDLE_BEFORE_S = 5.0               # cold baseline: idle after start-up
SETTLE_AFTER_WARMUP_S = 15.0      # warmed baseline: idle after the warm-up burst
RSS_TOLERANCE_MIB = 16.0          # "back to baseline": within this many MiB of the warmed baseline,
RSS_TOLERANCE_FRACTION = 0.05     # or this fraction of it, whichever is larger
MIB = 1024 * 1024
WARMUP_SLOT_OFFSET = 1000         # warm-up slots get their own seeds
EDGE_LOG_LINES = 200              # the edge's last log lines kept, for the error when it dies


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 180.0         # main phase: sessions keep starting until then
    sessions: int = 32                # concurrent device sessions
    warmup_sessions: int = 32         # the burst before the warmed baseline (one session each)
    cooldown_s: float = 20.0          # RSS sampling after the last session ended
    max_new_tokens: int = 96          # per session (EOS may end one earlier)
    draft_len: int = 4
    temperature: float = 1.0
    modes: tuple[str, ...] = tuple(m.value for m in Mode)  # rotated over sessions
    edge_workers: int = 2             # edge threads running target forwards (2 cores here)
    target: str | None = None         # HF dir; None = build tiny models into a temp dir
    draft: str | None = None
    draft_layers: int | None = None   # keep only the drafter's first N layers (early exit)
    out: str = "results/soak.json"
    seed: int = 0


# ------------------------------------------------------------------------------ edge process


class EdgeServer(Edge):
    """`edge-server` subprocess (the harness's: port from its ready line, log drained into ``lines``,
    the last EDGE_LOG_LINES kept), its RSS from /proc and its /metrics."""

    def __init__(self, target: str, workers: int, max_sessions: int):
        super().__init__("--model", target, "--workers", str(workers), "--max-sessions", str(max_sessions),
                         metrics=True, lines=collections.deque(maxlen=EDGE_LOG_LINES))

    def metric(self, name: str) -> dict[str, float]:
        """Samples of one metric family from the edge's /metrics: {labels: value}."""
        text = self.metrics()
        if text is None:
            raise RuntimeError("the edge's /metrics did not answer")
        return {m.group(1) or "": float(m.group(2))
                for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


class RssSampler:
    """A thread sampling the edge's RSS every RSS_PERIOD_S, tagged with the current phase."""

    def __init__(self, edge: EdgeServer, t0: float):
        self.edge, self.t0 = edge, t0
        self.phase = "start"
        self.samples: list[tuple[float, str, int]] = []  # (seconds since t0, phase, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self.t0, self.phase, self.edge.rss_bytes()))
            self._stop.wait(RSS_PERIOD_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def median(self, phase: str, last_s: float = RSS_WINDOW_S) -> float:
        """Median RSS (bytes) over the last ``last_s`` seconds of a phase."""
        xs = [(t, b) for t, p, b in self.samples if p == phase]
        end = xs[-1][0]
        return statistics.median(b for t, b in xs if t >= end - last_s)


# ------------------------------------------------------------------------------ device side


@dataclass
class Records:
    """What the device side measures: token and round events, session outcomes."""
    t0: float
    tokens: list[tuple[float, int]]          # (seconds since t0, tokens delivered)
    rounds: list[tuple[float, str, float]]   # (seconds since t0, mode, draft->verdict seconds)
    sessions: collections.Counter            # status -> count


class _TimedChannel:
    """A grpc.aio channel whose calls time each Draft -> Verdict round trip."""

    def __init__(self, channel, records: Records, mode: str):
        self._channel, self._records, self._mode = channel, records, mode

    def stream_stream(self, *args, **kwargs):
        multicallable = self._channel.stream_stream(*args, **kwargs)
        records, mode = self._records, self._mode

        class Call:
            def __init__(self, call):
                self._call, self._sent = call, None

            async def write(self, msg):
                if msg.HasField("draft"):
                    self._sent = time.perf_counter()
                await self._call.write(msg)

            async def read(self):
                msg = await self._call.read()
                if self._sent is not None and msg is not grpc.aio.EOF and msg.HasField("verdict"):
                    now = time.perf_counter()
                    records.rounds.append((time.monotonic() - records.t0, mode, now - self._sent))
                    self._sent = None
                return msg

            def __getattr__(self, name):
                return getattr(self._call, name)

        return lambda *a, **kw: Call(multicallable(*a, **kw))


async def one_session(channel, drafter, fingerprint: str, cfg: SoakConfig, records: Records,
                      mode: Mode, seed: int) -> None:
    rng = random.Random(seed)
    words = " ".join(f"w{rng.randrange(VOCAB_SIZE - 2)}" for _ in range(rng.randint(*PROMPT_WORDS)))
    device = DeviceConfig.of(mode=mode, temperature=cfg.temperature, draft_len=cfg.draft_len,
                          max_new_tokens=cfg.max_new_tokens, raw=True, **MODE_SETTINGS[mode])
    hello = device.hello(fingerprint, drafter.vocab_size, seed=seed)
    prompt_ids = encode_prompt(drafter.tokenizer, words, raw=True)

    def on_tokens(new: list[int]) -> None:
        records.tokens.append((time.monotonic() - records.t0, len(new)))

    try:
        await generate(_TimedChannel(channel, records, mode.value), DraftSession(drafter, hello), hello,
                       prompt_ids, drafter.eos_token_ids, on_tokens=on_tokens, timeout=SESSION_TIMEOUT_S)
        records.sessions["ok"] += 1
    except EdgeError as exc:
        records.sessions[exc.code.name.lower()] += 1


async def slot(address: str, drafter, fingerprint: str, cfg: SoakConfig, records: Records, index: int,
               until: float | None) -> None:
    """Sessions back to back on one channel until ``until`` (monotonic); one session if None."""
    modes = [Mode(m) for m in cfg.modes]
    async with open_channel(address) as channel:
        n = 0
        while True:
            seed = cfg.seed * 1_000_003 + index * 10_007 + n
            await one_session(channel, drafter, fingerprint, cfg, records, modes[(index + n) % len(modes)], seed)
            n += 1
            if until is None or time.monotonic() >= until:
                return


# ------------------------------------------------------------------------------ the run


def build_models(root: Path) -> tuple[str, str]:
    from specdec.testbed import tiny_models
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    target = tiny_models.make_model(root / "target", VOCAB_SIZE, seed=1, logit_scale=2.0, **TARGET_SHAPE)
    draft = tiny_models.make_close_drafter(target, root / "draft", noise=DRAFT_NOISE)
    return str(target), str(draft)


async def run_phases(cfg: SoakConfig, edge: EdgeServer, rss: RssSampler, drafter) -> tuple[Records, dict]:
    fingerprint = vocab_fingerprint(drafter.tokenizer)
    records = Records(t0=rss.t0, tokens=[], rounds=[], sessions=collections.Counter())
    times = {"loadavg_start": os.getloadavg()[0]}  # the cores may be shared: say how busy they were
    rss.phase = "cold"
    await asyncio.sleep(IDLE_BEFORE_S)
    rss.phase = "warmup"
    warm = Records(t0=rss.t0, tokens=[], rounds=[], sessions=collections.Counter())
    await asyncio.gather(*(slot(edge.address, drafter, fingerprint, cfg, warm, WARMUP_SLOT_OFFSET + i, None)
                           for i in range(cfg.warmup_sessions)))
    rss.phase = "settle"
    await asyncio.sleep(SETTLE_AFTER_WARMUP_S)
    rss.phase = "run"
    times["run_start"] = time.monotonic() - rss.t0
    until = time.monotonic() + cfg.duration_s
    await asyncio.gather(*(slot(edge.address, drafter, fingerprint, cfg, records, i, until)
                           for i in range(cfg.sessions)))
    times["run_end"] = time.monotonic() - rss.t0  # the last session has ended
    rss.phase = "cooldown"
    await asyncio.sleep(cfg.cooldown_s)
    times["cooldown_end"] = time.monotonic() - rss.t0
    times["warmup_sessions"] = dict(warm.sessions)
    return records, times


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def per_second(records: Records, rss: RssSampler) -> list[dict]:
    """One row per second of the whole run: phase, RSS, tokens/s, rounds and their latency."""
    tokens = collections.Counter()
    for t, n in records.tokens:
        tokens[int(t)] += n
    lat = collections.defaultdict(list)
    for t, _, s in records.rounds:
        lat[int(t)].append(s)
    rows = []
    for t, phase, b in rss.samples:
        sec = int(t)
        xs = lat.get(sec, [])
        rows.append({"t_s": round(t, 2), "phase": phase, "rss_mib": round(b / MIB, 2), "tokens_per_s": tokens.get(sec, 0),
                     "rounds": len(xs), "round_p50_ms": round(1e3 * percentile(xs, 0.5), 2) if xs else "",
                     "round_p99_ms": round(1e3 * percentile(xs, 0.99), 2) if xs else ""})
    return rows


def summarize(cfg: SoakConfig, records: Records, times: dict, rss: RssSampler, edge: EdgeServer) -> dict:
    run_s = times["run_end"] - times["run_start"]
    steady = (times["run_start"], times["run_start"] + cfg.duration_s)  # all slots busy; then they drain
    lat = [s for t, _, s in records.rounds]
    by_mode = collections.defaultdict(list)
    for _, mode, s in records.rounds:
        by_mode[mode].append(s)
    cold, warmed = rss.median("cold"), rss.median("settle")
    warmup_peak = max(b for _, p, b in rss.samples if p == "warmup")
    final = rss.median("cooldown")
    run_rss = [b for _, p, b in rss.samples if p == "run"]
    tolerance = max(RSS_TOLERANCE_MIB * MIB, RSS_TOLERANCE_FRACTION * warmed)
    half = [(t, b) for t, p, b in rss.samples if p == "run" and (steady[0] + steady[1]) / 2 <= t <= steady[1]]
    slope = _slope(half) * 60 / MIB if len(half) > 2 else float("nan")
    active = edge.metric("specdec_edge_sessions_active").get("", float("nan"))
    ended = edge.metric("specdec_edge_sessions_ended_total")
    total_tokens = sum(n for t, n in records.tokens)
    steady_tokens = sum(n for t, n in records.tokens if steady[0] <= t < steady[1])
    return {
        "config": asdict(cfg),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                    "loadavg_1min_start": times["loadavg_start"], "loadavg_1min_end": os.getloadavg()[0]},
        "run_seconds": run_s,
        "sessions": dict(records.sessions),
        "sessions_per_s": sum(records.sessions.values()) / run_s,
        "tokens": total_tokens,
        "tokens_per_s": steady_tokens / cfg.duration_s,  # over the steady window, all slots busy
        "tokens_per_round": total_tokens / len(lat) if lat else float("nan"),
        "rounds": len(lat),
        "round_latency_ms": {"p50": 1e3 * percentile(lat, 0.5), "p99": 1e3 * percentile(lat, 0.99),
                             "mean": 1e3 * statistics.fmean(lat) if lat else float("nan"),
                             "by_mode": {m: {"p50": 1e3 * percentile(xs, 0.5), "p99": 1e3 * percentile(xs, 0.99),
                                             "rounds": len(xs)} for m, xs in sorted(by_mode.items())}},
        "rss_mib": {"cold_baseline": cold / MIB, "warmup_peak": warmup_peak / MIB, "warmed_baseline": warmed / MIB,
                    "run_peak": max(run_rss) / MIB, "run_median": statistics.median(run_rss) / MIB,
                    "run_second_half_slope_mib_per_min": slope,
                    "after": final / MIB, "tolerance": tolerance / MIB,
                    "after_minus_warmed": (final - warmed) / MIB, "after_minus_cold": (final - cold) / MIB},
        "memory_back_to_baseline": final <= warmed + tolerance,
        "edge_sessions_active_after": active,
        "edge_sessions_ended": {k: v for k, v in ended.items() if v},
        "phases_s": times,
        "definition": (f"back to baseline: median RSS over the last {RSS_WINDOW_S:g} s of a {cfg.cooldown_s:g} s "
                       f"cooldown <= warmed baseline (median over the last {RSS_WINDOW_S:g} s of "
                       f"{SETTLE_AFTER_WARMUP_S:g} s idle after a burst of {cfg.warmup_sessions} sessions) + "
                       f"max({RSS_TOLERANCE_MIB:g} MiB, {RSS_TOLERANCE_FRACTION:.0%} of it)"),
    }


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares slope (bytes per second) of RSS over time."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mb = sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (b - mb) for t, b in points) / var if var else 0.0


def write_results(summary: dict, rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "series": rows}, indent=1) + "\n")
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_summary(s: dict, out: Path) -> None:
    r, lat = s["rss_mib"], s["round_latency_ms"]
    print(f"soak: {s['config']['sessions']} concurrent for {s['config']['duration_s']:.0f} s (+ drain: "
          f"{s['run_seconds']:.0f} s): {sum(s['sessions'].values())} sessions {s['sessions']}, {s['tokens']} tokens "
          f"({s['tokens_per_round']:.2f} per round), {s['tokens_per_s']:.1f} tokens/s while all were busy")
    print(f"  round latency (device, draft->verdict): p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} ms  "
          f"over {s['rounds']} rounds")
    for mode, m in lat["by_mode"].items():
        print(f"    {mode:5s} p50 {m['p50']:.1f} ms  p99 {m['p99']:.1f} ms  ({m['rounds']} rounds)")
    print(f"  edge RSS MiB: cold {r['cold_baseline']:.1f}, warm-up peak {r['warmup_peak']:.1f}, "
          f"warmed {r['warmed_baseline']:.1f}, run peak {r['run_peak']:.1f} "
          f"(2nd-half slope {r['run_second_half_slope_mib_per_min']:+.2f} MiB/min), after {r['after']:.1f} "
          f"({r['after_minus_warmed']:+.1f} vs warmed, tolerance {r['tolerance']:.1f})")
    print(f"  memory back to baseline: {s['memory_back_to_baseline']}; edge sessions open after: "
          f"{s['edge_sessions_active_after']:g}; ended on the edge: {s['edge_sessions_ended']}")
    m = s["machine"]
    print(f"  machine: {m['cpus']} cpus, 1-min load average {m['loadavg_1min_start']:.1f} at the start, "
          f"{m['loadavg_1min_end']:.1f} at the end")
    print(f"  wrote {out} and {out.with_suffix('.csv')}")


async def main(cfg: SoakConfig) -> dict:
    torch.set_num_threads(1)  # tiny models: thread hand-off costs more than it buys, cores are shared
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        target, draft = (cfg.target, cfg.draft) if cfg.target else build_models(Path(tmp))
        edge = EdgeServer(target, cfg.edge_workers, max_sessions=max(64, 2 * cfg.sessions))
        try:
            drafter = load_model(ModelSpec(model=draft, num_layers=cfg.draft_layers))
            rss = RssSampler(edge, time.monotonic())
            records, times = await run_phases(cfg, edge, rss, drafter)
            rss.stop()
            summary = summarize(cfg, records, times, rss, edge)
            rows = per_second(records, rss)
        finally:
            edge.stop()
    out = Path(cfg.out)  # relative: to the directory it runs in (make: the repository root)
    write_results(summary, rows, out)
    print_summary(summary, out)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=SoakConfig.duration_s, help="seconds of the main phase")
    p.add_argument("--sessions", type=int, default=SoakConfig.sessions)
    p.add_argument("--warmup-sessions", type=int, default=SoakConfig.warmup_sessions)
    p.add_argument("--cooldown", type=float, default=SoakConfig.cooldown_s)
    p.add_argument("--max-new-tokens", type=int, default=SoakConfig.max_new_tokens)
    p.add_argument("--draft-len", type=int, default=SoakConfig.draft_len)
    p.add_argument("--temperature", type=float, default=SoakConfig.temperature)
    p.add_argument("--modes", default=",".join(SoakConfig.modes), help="comma-separated, rotated over sessions")
    p.add_argument("--edge-workers", type=int, default=SoakConfig.edge_workers)
    p.add_argument("--target", help="target HF directory (default: tiny models built into a temp dir)")
    p.add_argument("--draft", help="drafter HF directory (with --target)")
    p.add_argument("--draft-layers", type=int, help="keep the drafter's first N layers")
    p.add_argument("--out", default=SoakConfig.out)
    p.add_argument("--seed", type=int, default=SoakConfig.seed)
    a = p.parse_args()
    if bool(a.target) != bool(a.draft):
        p.error("--target and --draft go together")
    config = SoakConfig(duration_s=a.duration, sessions=a.sessions, warmup_sessions=a.warmup_sessions,
                        cooldown_s=a.cooldown, max_new_tokens=a.max_new_tokens, draft_len=a.draft_len,
                        temperature=a.temperature, modes=tuple(a.modes.split(",")), edge_workers=a.edge_workers,
                        target=a.target, draft=a.draft, draft_layers=a.draft_layers, out=a.out, seed=a.seed)
    from specdec.common.runtime import run_async
    summary = run_async(main(config))
    sys.exit(0 if summary["memory_back_to_baseline"] and summary["edge_sessions_active_after"] == 0 else 1)
