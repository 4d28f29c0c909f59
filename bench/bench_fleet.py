"""bench-fleet (issue 34): devices through HAProxy (deploy/haproxy/haproxy.cfg as committed) over
1, 2 and 3 edge-servers, then a SIGKILL and a SIGTERM drain in the middle of a run.

    make bench-fleet                       # ~8 min on 2 shared cores (--quick: ~3)
    python -m specdec.bench.bench_fleet [--devices 6] [--seconds 15] [--faults 24] [--tokens 160]
        [--repeats 6] [--quick]

Three phases, on one set of edges (each an edge-server process, one torch thread, all pinned to the
last core; the proxy and the devices, one asyncio process, pinned to the others):

1. throughput: ``--devices`` devices run sessions back to back for ``--seconds`` through the proxy,
   with 1, 2 and 3 of the edges behind it (the others' slots point at a closed port, so the proxy
   marks them down), interleaved; aggregate tokens/s and sessions per edge;
2. faults: ``--faults`` devices each run one session of ``--tokens`` tokens at T = 1 (seeds fixed)
   through the proxy and 3 edges; once 30 % of all tokens are delivered the busiest edge gets
   SIGKILL, at 60 % the busiest left gets SIGTERM (it drains: ``--drain-timeout 2``). Every
   session's tokens are compared with the same seed's run against an edge nothing disturbs. For
   each session that moved, its stall (the gap between the last token before the move and the first
   after it) against the re-prefill of its verified prefix plus one round measured in place (the
   new stream's Welcome to that first token); sessions moved, KV reused against re-prefilled
   (device trails and the edges' counters); tokens/s over time with the kill and the drain marked;
3. proxy cost: one device, the same greedy session alternately through the proxy (one edge behind
   it) and straight to that edge, ``--repeats`` times each; tokens/s through the proxy over direct.

The edges run ``--no-batching``: a batching edge advises devices to draft shorter as its load grows
(load-aware speculation), so round boundaries, and with them which random numbers each T = 1 token
uses, depend on timing; the law holds either way, but tokens identical to another run need the same
rounds. Without batching every round is the device's own fixed choice.

The models are tiny random Llamas made here (testbed/tiny_models, vocabulary 2048; the drafter a
perturbed copy of the target): the benchmark measures the fleet, not the models, and short rounds
make the proxy's share of a round larger than with real models. With two cores, 1, 2 and 3 edges
share one core: phase 1 shows what the proxy and the balancing cost, not how the fleet scales.

Writes results/bench_fleet/<timestamp>/ (and results/bench_fleet/latest): bench_fleet.json (every
session, per-phase numbers, goals), fleet_timeline.png, logs/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.harness import analyze, plan
from specdec.bench.harness.analyze import percentile, print_goals
from specdec.bench.harness.rig import Edge
from specdec.common.modeling import ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.common.runtime import run_async
from specdec.device.client import ConnectionPolicy, EdgeError, generate
from specdec.device.factory import DeviceConfig, open_channel
from specdec.device.session import DraftSession
from specdec.testbed import haproxy, procs, tiny_models

RESULTS = plan.RESULTS / "bench_fleet"
VOCAB, HIDDEN, LAYERS, POSITIONS = 2048, 128, 4, 1024
PROMPT = " ".join(f"w{i}" for i in range(10, 42))        # 32 prompt tokens
DRAFT = dict(mode="tslt", top_k=64, draft_len=4)
KILL_AT, DRAIN_AT = 0.3, 0.6       # shares of the fault phase's tokens delivered
EDGE_DRAIN_S = 2.0                  # the drained edge's --drain-timeout: some sessions finish, the rest move
TIMELINE_BIN_S = 1.0
POLICY = ConnectionPolicy(round_timeout_s=30.0, reconnect_timeout_s=60.0)
DEAD_ADDRESS = "127.0.0.1:1"        # an edge slot of the proxy that is empty


@dataclass
class Settings:
    devices: int = 6
    seconds: float = 15.0
    faults: int = 24
    tokens: int = 160
    repeats: int = 6
    edge_cpus: tuple[int, ...] = ()
    device_cpus: tuple[int, ...] = ()
    quick: bool = False
    replot: Path | None = None


@dataclass
class Timeline:
    """Tokens as delivered: (time.monotonic(), device, count)."""
    events: list = field(default_factory=list)

    def tap(self, device: int):
        return lambda new: self.events.append((time.monotonic(), device, len(new)))


def _models(root: Path) -> tuple[Path, Path]:
    target = root / "target"
    if not (target / "config.json").exists():
        tiny_models.make_model(target, VOCAB, seed=1, hidden=HIDDEN, layers=LAYERS, max_positions=POSITIONS)
        tiny_models.make_close_drafter(target, root / "drafter", noise=0.3)
    return target, root / "drafter"


class Sessions:
    """The devices' side: one drafter loaded once, sessions over a channel (to the proxy or an edge)."""

    def __init__(self, drafter_dir: Path):
        self.drafter = load_model(ModelSpec(model=str(drafter_dir)))
        self.prompt = encode_prompt(self.drafter.tokenizer, PROMPT, raw=True)
        self.fingerprint = vocab_fingerprint(self.drafter.tokenizer)

    async def one(self, channel, seed: int, temperature: float, tokens: int, on_tokens=None):
        cfg = DeviceConfig.of(raw=True, temperature=temperature, max_new_tokens=tokens, **DRAFT)
        hello = cfg.hello(self.fingerprint, self.drafter.vocab_size, seed=seed)
        return await generate(channel, DraftSession(self.drafter, hello), hello, self.prompt,
                              self.drafter.eos_token_ids, on_tokens=on_tokens, timeout=600, policy=POLICY)


# ----------------------------------------------------------------------------- phase 1
async def throughput(sessions: Sessions, proxy_address: str, s: Settings, n_edges: int) -> dict:
    timeline, done, failed, per_edge = Timeline(), [], [], {}
    stop_at = time.monotonic() + s.seconds

    async def device(i: int, channel):
        k = 0
        while time.monotonic() < stop_at:
            try:
                r = await sessions.one(channel, 10_000 * i + k, 1.0, s.tokens, timeline.tap(i))
                done.append(r)
                per_edge[r.trail.edges[0]] = per_edge.get(r.trail.edges[0], 0) + 1
            except EdgeError as e:
                failed.append(str(e))
            k += 1
    t0 = time.monotonic()
    async with open_channel(proxy_address) as channel:
        await asyncio.gather(*(device(i, channel) for i in range(s.devices)))
    window = [n for t, _, n in timeline.events if t <= stop_at]
    return {"edges": n_edges, "devices": s.devices, "seconds": s.seconds, "sessions": len(done),
            "failed": failed, "tokens_per_second": sum(window) / (stop_at - t0), "sessions_per_edge": per_edge}


# ----------------------------------------------------------------------------- phase 2
async def faults(sessions: Sessions, proxy_address: str, edges: list[Edge], s: Settings) -> dict:
    timeline, marks = Timeline(), {}
    total = s.faults * s.tokens
    delivered = {"n": 0}

    def on_tokens_for(i):
        tap = timeline.tap(i)

        def on_tokens(new):
            tap(new)
            delivered["n"] += len(new)
            if delivered["n"] >= KILL_AT * total and "kill" not in marks:
                marks["kill"] = _strike(edges, marks, "kill")
            elif delivered["n"] >= DRAIN_AT * total and "drain" not in marks:
                marks["drain"] = _strike(edges, marks, "drain")
        return on_tokens
    t0 = time.monotonic()
    async with open_channel(proxy_address) as channel:
        results = await asyncio.gather(*(sessions.one(channel, 500 + i, 1.0, s.tokens, on_tokens_for(i))
                                         for i in range(s.faults)), return_exceptions=True)
    return {"t0": t0, "results": results, "timeline": timeline.events, "marks": marks}


def _strike(edges: list[Edge], marks: dict, kind: str) -> dict:
    """SIGKILL (kill) or SIGTERM (drain) the edge running the most sessions now."""
    alive = [e for e in edges if e.proc.poll() is None and e.name not in [m["edge"] for m in marks.values()]]
    load = {e.name: e.sessions_active() for e in alive}
    victim = max(alive, key=lambda e: load[e.name])
    (victim.proc.kill if kind == "kill" else victim.proc.terminate)()
    return {"edge": victim.name, "t": time.monotonic(), "sessions_active": load}


def stalls(result, events: list, device: int) -> list[dict]:
    """For each move of one session: its stall and the re-prefill of its prefix plus one round."""
    times = sorted(t for t, d, _ in events if d == device)
    out = []
    for (t_welcome, edge), (_, before) in zip(result.trail.welcomes[1:], result.trail.welcomes):
        if edge == before:
            continue
        last = max((t for t in times if t < t_welcome), default=None)
        first = min((t for t in times if t > t_welcome), default=None)
        if last is None or first is None:
            continue
        out.append({"from": before, "to": edge, "stall_s": first - last, "reprefill_and_round_s": first - t_welcome,
                    "prefix_tokens": len(PROMPT.split()) + sum(n for t, d, n in events if d == device and t < t_welcome)})
    return out


# ----------------------------------------------------------------------------- phase 3
async def proxy_cost(sessions: Sessions, proxy_address: str, edge_address: str, s: Settings) -> dict:
    rates = {"proxy": [], "direct": []}
    async with open_channel(proxy_address) as via, open_channel(edge_address) as direct:
        await sessions.one(via, 1, 0.0, s.tokens)  # warm both paths
        await sessions.one(direct, 1, 0.0, s.tokens)
        for k in range(s.repeats):
            for name, channel in plan.rotated([("proxy", via), ("direct", direct)], k):
                r = await sessions.one(channel, 1, 0.0, s.tokens)
                rates[name].append(len(r.token_ids) / r.wall_seconds)
    median = {k: percentile(v, 50) for k, v in rates.items()}
    return {"tokens_per_second": rates, "median": median, "ratio": median["proxy"] / median["direct"]}


# ----------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    s = parse(argv)
    if s.replot:
        plot(json.loads((s.replot / "bench_fleet.json").read_text()), s.replot / "fleet_timeline.png")
        return 0
    out = plan.run_dir(RESULTS, plan.stamp(s.quick))
    target_dir, drafter_dir = _models(out.parent / ".models")
    if s.device_cpus:
        os.sched_setaffinity(0, set(s.device_cpus))
    names = ["edge1", "edge2", "edge3"]
    edges = [Edge("--model", str(target_dir), "--name", n, "--drain-timeout", str(EDGE_DRAIN_S), "--workers", "8",
                  "--no-batching",
                  log=out / "logs" / f"{n}.log", cpus=s.edge_cpus, metrics=True) for n in names]
    for e, n in zip(edges, names):
        e.name = n
    print(f"edges up: {[e.address for e in edges]}; edges on CPUs {s.edge_cpus or 'all'}, proxy and devices on "
          f"{s.device_cpus or 'all'}", flush=True)
    record = {"settings": s.__dict__, "models": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS},
              "machine": plan.machine_info(), "git": plan.git_info()}
    try:
        sessions = Sessions(drafter_dir)
        record["throughput"] = []
        for n_edges in plan.rotated([1, 2, 3], 1):
            with _proxy(edges, n_edges, s) as proxy:
                cell = run_async(throughput(sessions, proxy.address, s, n_edges))
            record["throughput"].append(cell)
            print(f"throughput, {n_edges} edge(s): {cell['tokens_per_second']:.1f} tok/s, {cell['sessions']} sessions "
                  f"{cell['sessions_per_edge']}, {len(cell['failed'])} failed", flush=True)
        with _proxy(edges, 1, s) as proxy:
            record["proxy_cost"] = run_async(proxy_cost(sessions, proxy.address, edges[0].address, s))
        print(f"proxy cost: {record['proxy_cost']['median']}", flush=True)
        before = [_counters(e) for e in edges]
        with _proxy(edges, 3, s) as proxy:
            run = run_async(faults(sessions, proxy.address, edges, s))
        after = [_counters(e) for e in edges]
        for mark in run["marks"].values():  # the killed edge and the drained one, gone
            record.setdefault("exit_codes", {})[mark["edge"]] = next(
                e for e in edges if e.name == mark["edge"]).proc.wait(60)
        reference = run_async(_unbroken(sessions, edges, s))
        record["faults"] = summarize_faults(run, reference, before, after, s)
    finally:
        for e in edges:
            e.stop()
    record["goals"] = goals(record)
    (out / "bench_fleet.json").write_text(json.dumps(record, indent=1, default=str))
    plot(record, out / "fleet_timeline.png")
    print_goals("goals", record["goals"])
    print(f"results: {out}")
    return 0


def _counters(edge: Edge) -> dict:
    text = edge.metrics() or ""
    names = ("specdec_edge_sessions_resumed_total", "specdec_edge_sessions_reprefilled_total")
    return {n: float(l.split()[1]) for l in text.splitlines() for n in names if l.startswith(n + " ")}


async def _unbroken(sessions: Sessions, edges: list[Edge], s: Settings) -> list[list[int]]:
    """The fault phase's sessions against an edge nothing disturbs (the one left)."""
    alive = next(e for e in edges if e.proc.poll() is None)
    async with open_channel(alive.address) as channel:
        results = await asyncio.gather(*(sessions.one(channel, 500 + i, 1.0, s.tokens) for i in range(s.faults)))
    return [r.token_ids for r in results]


class _proxy:
    """The committed HAProxy config with ``n`` of the edges behind it (the other slots empty)."""

    def __init__(self, edges: list[Edge], n: int, s: Settings):
        slots = [(e.address, e.metrics_port) for e in edges[:n]]
        slots += [(DEAD_ADDRESS, procs.free_port()) for _ in range(haproxy.EDGES - n)]
        self.proxy = haproxy.Proxy(slots, cpus=s.device_cpus)
        for i in range(n + 1, haproxy.EDGES + 1):
            self.proxy.wait_for(rf"edges/edge{i} is DOWN", 10)

    def __enter__(self):
        return self.proxy

    def __exit__(self, *exc):
        self.proxy.stop()


def summarize_faults(run: dict, reference: list[list[int]], before: list[dict], after: list[dict], s: Settings) -> dict:
    results = run["results"]
    failed = [str(r) for r in results if isinstance(r, BaseException)]
    ok = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    identical = sum(r.token_ids == reference[i] for i, r in ok)
    moves = [m for i, r in ok for m in stalls(r, run["timeline"], i)]
    ratios = [m["stall_s"] / m["reprefill_and_round_s"] for m in moves if m["reprefill_and_round_s"] > 0]
    counter = lambda name: sum(a[name] - b.get(name, 0) for a, b in zip(after, before) if name in a)  # noqa: E731
    t0 = run["t0"]
    return {
        "sessions": len(results), "completed": len(ok), "failed": failed, "identical_to_unbroken": identical,
        "tokens_missing_or_extra": sum(abs(len(r.token_ids) - len(reference[i])) for i, r in ok),
        "marks": {k: {**v, "t": v["t"] - t0} for k, v in run["marks"].items()},
        "sessions_moved": sum(1 for _, r in ok if r.trail.moves),
        "moves": moves, "stall_s": {"p50": percentile([m["stall_s"] for m in moves], 50),
                                    "p95": percentile([m["stall_s"] for m in moves], 95)},
        "reprefill_and_round_s": {"p50": percentile([m["reprefill_and_round_s"] for m in moves], 50),
                                  "p95": percentile([m["reprefill_and_round_s"] for m in moves], 95)},
        "stall_over_reprefill_and_round": {"p50": percentile(ratios, 50), "p95": percentile(ratios, 95)},
        "kv_resumes": sum(r.trail.kv_resumes for _, r in ok), "reprefills": sum(r.trail.reprefills for _, r in ok),
        # the edges' own counts, of the edges still up at the end (the killed and drained ones are gone)
        "surviving_edge_counters": {"kv_resumed": counter("specdec_edge_sessions_resumed_total"),
                                    "reprefilled": counter("specdec_edge_sessions_reprefilled_total")},
        "timeline": [(t - t0, d, n) for t, d, n in run["timeline"]],
        "trails": [r.trail.to_json() for _, r in ok],
    }


def goals(record: dict) -> dict:
    f = record["faults"]
    return {
        "kill_complete": analyze.goal(f"sessions complete through a SIGKILL of one of three edges ({f['sessions']} "
                                      "in flight)", f["completed"], f["sessions"]),
        "identical": analyze.goal("sessions with tokens identical to an unbroken run", f["identical_to_unbroken"],
                                  f["sessions"]),
        "no_token_lost": analyze.goal("tokens missing or duplicated at the device", f["tokens_missing_or_extra"], 0,
                                      at_most=True),
        "stall": analyze.goal("p95 of a moved session's stall over its re-prefill plus one round",
                              f["stall_over_reprefill_and_round"]["p95"], 2.0, at_most=True),
        "drain": analyze.goal("sessions failed through the kill and the drain", len(f["failed"]), 0, at_most=True),
        "proxy": analyze.goal("tokens/s through the proxy over direct to the same edge", record["proxy_cost"]["ratio"],
                              0.97),
    }


def plot(record: dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    from specdec.bench.harness.plots import save
    f = record["faults"]
    end = max((t for t, _, _ in f["timeline"]), default=0.0)
    bins = [0.0] * (int(end / TIMELINE_BIN_S) + 1)
    for t, _, n in f["timeline"]:
        bins[int(t / TIMELINE_BIN_S)] += n
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([i * TIMELINE_BIN_S for i in range(len(bins))], [b / TIMELINE_BIN_S for b in bins], lw=1.2,
            label=f"{f['sessions']} sessions through HAProxy")
    for kind, colour in (("kill", "tab:red"), ("drain", "tab:orange")):
        if kind in f["marks"]:
            m = f["marks"][kind]
            ax.axvline(m["t"], color=colour, ls="--", label=f"{'SIGKILL' if kind == 'kill' else 'SIGTERM'} {m['edge']}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s (all devices)")
    ax.legend(fontsize=7)
    note = (f"bench-fleet {record['git'].get('revision', '')[:10]}; tiny Llama V={VOCAB}; edges pinned to CPUs "
            f"{record['settings']['edge_cpus']}, devices+proxy to {record['settings']['device_cpus']}")
    save(fig, path, note)


def parse(argv) -> Settings:
    p = argparse.ArgumentParser(prog="bench-fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=Settings.devices, help="devices in the throughput phase")
    p.add_argument("--seconds", type=float, default=Settings.seconds, help="seconds per throughput cell")
    p.add_argument("--faults", type=int, default=Settings.faults, help="sessions in flight for the kill and drain")
    p.add_argument("--tokens", type=int, default=Settings.tokens, help="tokens per session")
    p.add_argument("--repeats", type=int, default=Settings.repeats, help="proxy-cost sessions per path")
    p.add_argument("--quick", action="store_true", help="3 devices x 5 s, 12 sessions of 64 tokens, 3 repeats")
    p.add_argument("--replot", type=Path, help="redraw a finished run's plot from its bench_fleet.json")
    a = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    # The edges share the last core; the proxy and the devices get the others (one core here).
    edge_cpus, device_cpus = (tuple(cores[-1:]), tuple(cores[:-1])) if len(cores) > 1 else ((), ())
    s = Settings(a.devices, a.seconds, a.faults, a.tokens, a.repeats, edge_cpus, device_cpus, a.quick, a.replot)
    if a.quick:
        s.devices, s.seconds, s.faults, s.tokens, s.repeats = 3, 5.0, 12, 64, 3
    return s


if __name__ == "__main__":
    raise SystemExit(main())
