"""bench-seeded (issue 44): same seed, same tokens, over real edge-server processes.

    make bench-seeded                      # 10 runs of each scenario (~25 min on 2 shared cores)
    python -m specdec.bench.bench_seeded [--runs 10] [--sessions 8] [--tokens 24] [--scenarios load-1,kill,...]
        [--target-model DIR --target-gguf-file F] [--other-draft-layers 8] [--no-control] [--mode gumbel]

The device runs here (one asyncio process: the default drafter, ``factory.new_session`` as
``device-client`` makes sessions, mode auto with one memory of the link per drafter for the whole
bench, T = 1, seeds 0..N-1, each session its own prompt of bench/prompts.jsonl, reproducibility as by
default for a seeded session). Edges are ``edge-server``
processes on loopback with their defaults (batching on; the embedded target unless ``--target-*``).
The reference: the sessions one at a time on a quiet edge. Each scenario runs ``--runs`` times and
compares every session's tokens with the reference's:

- ``load-1``, ``load-4``, ``load-8``: the sessions 1, 4 and 8 at a time on one batching edge (the
  batch, the load advice and auto's timing differ run to run);
- ``kill``: all at once over a fleet of two batching edges; once half the tokens are delivered the
  edge serving the most sessions gets SIGKILL (it is restarted before the next run);
- ``drafter``: all at once with another drafter of the same tokenizer (the embedded target's first
  ``--other-draft-layers`` layers, the interim drafter);
- ``link``: all at once through the userspace link emulator (testbed/linkemu.py), whose link changes
  mid-run: 100 Mbit/s 5 ms -> 1 Mbit/s 100 ms -> back.

Control (``--no-control`` leaves it out): ``load-8`` with reproducibility off (``--no-reproducible``),
whose tokens are expected to differ: the comparison can fail. Positions compared: every token of
every session; a batched forward whose numerics flipped a token would show as a differing session.

Writes results/bench_seeded/<timestamp>/bench_seeded.json (per scenario and run: sessions identical,
first differing position, tokens compared; auto's rounds by mode) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.rig import Edge  # noqa: E402
from specdec.common.modeling import encode_prompt, load_model, vocab_fingerprint  # noqa: E402
from specdec.device.auto import LinkTracker  # noqa: E402
from specdec.device.client import ConnectionPolicy, generate  # noqa: E402
from specdec.device.fleet import Fleet  # noqa: E402
from specdec.device.factory import DeviceConfig, choose_drafter, new_session, open_channel  # noqa: E402
from specdec.testbed.linkemu import LinkEmulator, LinkSpec  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_seeded"
PROMPTS = Path(__file__).with_name("prompts.jsonl")
SCENARIOS = ("load-1", "load-4", "load-8", "kill", "drafter", "link")
CONTROL = "load-8-free"
TEMPERATURE = 1.0
# the changing link: (seconds into the run, uplink bps, one-way delay s); downlink = 4x the uplink
LINK_PHASES = ((0.0, 100e6, 0.0025), (2.0, 1e6, 0.05), (4.0, 100e6, 0.0025))
DOWN_FACTOR = 4
POLICY = ConnectionPolicy(round_timeout_s=120.0, reconnect_timeout_s=60.0, backoff_initial_s=0.05, backoff_max_s=0.5)
KILL_AT = 0.5            # share of all tokens delivered when the busiest edge is killed
SESSION_TIMEOUT_S = 900.0


def prompts(n: int) -> list[str]:
    lines = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()]
    return [lines[i % len(lines)] for i in range(n)]


class Bench:
    def __init__(self, a, out: Path):
        self.a, self.out = a, out
        self.cfg = DeviceConfig.of(temperature=TEMPERATURE, max_new_tokens=a.tokens, timeout=SESSION_TIMEOUT_S,
                                   **({} if a.mode == "auto" else {"mode": a.mode}))
        self.edge_args = (("--model", a.target_model) if a.target_model else ()) \
            + (("--gguf-file", a.target_gguf_file) if a.target_gguf_file else ())
        choice = choose_drafter(self.cfg)
        self.drafter, self.operating_point = load_model(choice.spec), choice.operating_point
        other = choose_drafter(replace(self.cfg, draft_layers=a.other_draft_layers))
        self.other = load_model(other.spec) if "drafter" in a.scenarios else None
        # one memory of the link per drafter for the whole bench, as a device keeps one: auto's choices
        # change from run to run as it learns (what the tokens must not depend on)
        self.trackers = {id(self.drafter): LinkTracker(), id(self.other): LinkTracker()}
        self.prompt_ids = [encode_prompt(self.drafter.tokenizer, p, raw=False) for p in prompts(a.sessions)]

    def edge(self, name: str) -> Edge:
        # its /metrics: the kill picks the edge serving the most sessions
        return Edge(*self.edge_args, "--name", name, log=self.out / "logs" / f"edge-{name}.log", metrics=True)

    async def sessions(self, target, concurrency: int, cfg: DeviceConfig, drafter=None, on_tokens=None):
        """Every seed's session over ``target`` (a channel or a Fleet), ``concurrency`` at a time:
        [(tokens, rounds by mode, edges)]."""
        drafter = drafter or self.drafter
        gate = asyncio.Semaphore(concurrency)

        async def one(seed: int):
            async with gate:
                hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=seed,
                                  operating_point=self.operating_point if drafter is self.drafter else ())
                session = new_session(cfg, drafter, hello, self.trackers[id(drafter)])
                modes = Counter()
                session.listeners.append(lambda event: modes.update([event.settings.mode.value]))
                r = await generate(target, session, hello, self.prompt_ids[seed], drafter.eos_token_ids,
                                   on_tokens=on_tokens, timeout=cfg.timeout, policy=POLICY)
                return r.token_ids, dict(modes), list(r.trail.edges)
        return await asyncio.gather(*(one(s) for s in range(self.a.sessions)))

    async def on_one_edge(self, edge: Edge, concurrency: int, cfg: DeviceConfig, drafter=None):
        async with open_channel(edge.address) as channel:
            return await self.sessions(channel, concurrency, cfg, drafter)

    async def through_changing_link(self, edge: Edge):
        host, port = edge.address.rsplit(":", 1)
        emu = LinkEmulator((host, int(port)), LinkSpec(), LinkSpec())
        address = f"127.0.0.1:{await emu.start('127.0.0.1', 0)}"
        t0 = time.monotonic()

        async def change():
            for at, rate, delay in LINK_PHASES:
                await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
                emu.set_specs(LinkSpec(rate_bps=rate, delay_s=delay), LinkSpec(rate_bps=DOWN_FACTOR * rate, delay_s=delay))
        changer = asyncio.create_task(change())
        try:
            async with open_channel(address) as channel:
                return await self.sessions(channel, self.a.sessions, self.cfg)
        finally:
            changer.cancel()
            await emu.close()

    async def with_a_kill(self, edges: list[Edge]):
        total = self.a.sessions * self.a.tokens
        seen = {"n": 0, "killed": None}

        def on_tokens(new):
            seen["n"] += len(new)
            if seen["killed"] is None and seen["n"] >= KILL_AT * total:
                victim = max(edges, key=Edge.sessions_active)
                seen["killed"] = victim
                victim.proc.send_signal(signal.SIGKILL)
        async with Fleet([e.address for e in edges], lambda t, o: open_channel(t, o)) as fleet:
            got = await self.sessions(fleet, self.a.sessions, self.cfg, on_tokens=on_tokens)
        return got, seen["killed"]


def compare(reference: list, got: list) -> dict:
    same = [ref[0] == g[0] for ref, g in zip(reference, got)]
    first = [next((i for i, (x, y) in enumerate(zip(ref[0], g[0])) if x != y), min(len(ref[0]), len(g[0])))
             for ref, g in zip(reference, got) if ref[0] != g[0]]
    modes = sum((Counter(g[1]) for g in got), Counter())
    return {"identical_sessions": sum(same), "sessions": len(same), "first_difference": first,
            "tokens_compared": sum(min(len(r[0]), len(g[0])) for r, g in zip(reference, got)),
            "rounds_by_mode": dict(modes), "moved_sessions": sum(len(set(g[2])) > 1 for g in got)}


async def run_all(b: Bench, a) -> dict:
    results: dict[str, list] = {}
    edge = b.edge("one")
    try:
        reference = await b.on_one_edge(edge, 1, b.cfg)
        print(f"reference: {sum(len(t) for t, _, _ in reference)} tokens, rounds by mode "
              f"{dict(sum((Counter(m) for _, m, _ in reference), Counter()))}", flush=True)
        plan = [s for s in SCENARIOS if s in a.scenarios] + ([CONTROL] if a.control else [])
        for name in plan:
            results[name] = []
            for run in range(a.runs):
                t0 = time.monotonic()
                got, extra = await one_run(b, name, edge)
                row = {**compare(reference, got), "seconds": time.monotonic() - t0, **extra}
                results[name].append(row)
                print(f"{name:<12} run {run + 1:>2}: {row['identical_sessions']}/{row['sessions']} sessions identical, "
                      f"{row['tokens_compared']} tokens, rounds {row['rounds_by_mode']}"
                      + (f", moved {row['moved_sessions']}" if name == "kill" else ""), flush=True)
    finally:
        edge.stop()
    return {"reference": [{"tokens": t, "rounds_by_mode": m} for t, m, _ in reference], "scenarios": results}


async def one_run(b: Bench, name: str, edge: Edge):
    if name.startswith("load-"):
        free = name == CONTROL
        cfg = replace(b.cfg, reproducible=False) if free else b.cfg
        n = b.a.sessions if free else int(name.split("-")[1])
        return await b.on_one_edge(edge, n, cfg), {}
    if name == "drafter":
        return await b.on_one_edge(edge, b.a.sessions, b.cfg, b.other), {}
    if name == "link":
        return await b.through_changing_link(edge), {}
    if name == "kill":
        edges = [b.edge("a"), b.edge("b")]
        try:
            got, killed = await b.with_a_kill(edges)
            return got, {"killed_edge": None if killed is None else "ab"[edges.index(killed)]}
        finally:
            for e in edges:
                e.stop()
    raise ValueError(name)


def summarize(data: dict) -> dict:
    out = {}
    for name, runs in data["scenarios"].items():
        identical = sum(r["identical_sessions"] for r in runs)
        total = sum(r["sessions"] for r in runs)
        out[name] = {"identical_sessions": identical, "sessions": total, "runs": len(runs),
                     "tokens_compared": sum(r["tokens_compared"] for r in runs),
                     "all_identical": identical == total}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--no-control", dest="control", action="store_false")
    p.add_argument("--mode", default="auto", help="the sessions' mode (default: auto, as device-client runs)")
    p.add_argument("--target-model", default=None, help="edge-server --model (default: its embedded target)")
    p.add_argument("--target-gguf-file", default=None)
    p.add_argument("--other-draft-layers", type=int, default=8, help="the other drafter: the target's first N layers")
    a = p.parse_args(argv)
    a.scenarios = tuple(x for x in a.scenarios.split(",") if x)
    unknown = set(a.scenarios) - set(SCENARIOS)
    if unknown or a.runs < 1 or a.sessions < 1 or a.tokens < 1:
        p.error(f"unknown scenarios {sorted(unknown)}" if unknown else "--runs, --sessions, --tokens must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    out = harness_plan.run_dir(RESULTS, time.strftime("%Y%m%d-%H%M%S"))
    t0 = time.monotonic()
    b = Bench(a, out)
    data = asyncio.run(run_all(b, a))
    data.update(args={k: v for k, v in vars(a).items()}, summary=summarize(data), wall_s=time.monotonic() - t0)
    (out / "bench_seeded.json").write_text(json.dumps(data, indent=1, default=str))
    print("\nsessions identical to the reference (same seed, same tokens)")
    for name, s in data["summary"].items():
        verdict = "control: reproducibility off" if name == CONTROL else ("PASS" if s["all_identical"] else "MISS")
        print(f"  {name:<12} {s['identical_sessions']:>4}/{s['sessions']:<4} over {s['runs']} runs, "
              f"{s['tokens_compared']} tokens  [{verdict}]")
    print(f"results: {out}\nwall {data['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
