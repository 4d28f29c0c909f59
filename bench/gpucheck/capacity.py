"""Capacity on the device: bench-capacity's replay load generator against real ``edge-server``
processes on loopback, batched vs --no-batching vs edge-only.

A random model makes any drafter meaningless, so the devices' proposals are built from the target's
own greedy path (what the edge itself generated, checked against transformers' greedy generate of the
same weights): at each position, each drafted token is the path's with probability ``alpha`` and
another token otherwise, so every position is accepted with probability ``alpha`` (T = 0: the edge
accepts exactly the path's tokens). Replayed devices (specdec.bench.capacity.scripts.GreedyScript) follow the
edge's load-aware advice, draft ahead on its clock, sleep ``draft_ms`` per drafted token, and check
every verdict against the path (a verdict off it is a divergence: a wrong forward).
"""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.common.codecs import encode_distribution
from specdec.common.modeling import vocab_fingerprint
from specdec.common.runtime import run_async
from specdec.device.factory import DeviceConfig

from specdec.bench.capacity import analyze, replay
from specdec.bench.capacity.recording import PositionTable, Proposal
from specdec.bench.capacity.scripts import EdgeOnlyScript, GreedyScript
from specdec.bench.harness.rig import Edge

WARMUP_TOKENS = 6
VARIANT = "variant"  # the edge of Settings.variant_args, and its cells' "edge"
EDGE_COMMON = ("--max-sessions", "160", "--max-sessions-per-principal", "0")  # all clients are one host


@dataclass(frozen=True)
class Settings:
    ns: tuple[int, ...]              # devices at once, in the order measured (the goals' N first)
    alphas: tuple[float, ...]        # per-position acceptance of the proposals
    tokens: int                      # per session
    prompts: int                     # distinct prompts (client i: prompt i mod prompts)
    prompt_len: int
    draft_len: int                   # the devices' own L (the edge's advice may shorten it)
    draft_max: int                   # tokens per proposal (longest round the advice may allow)
    draft_ms: float                  # device drafting time per token
    edge_args: tuple[str, ...] = ()  # extra edge-server flags (e.g. --kv-cache slots on the CPU smoke run)
    variant_args: tuple[str, ...] | None = None  # an A/B's other arm in the same run: a second batched
                                                 # edge with these flags more, its batched and edge-only
                                                 # cells beside the first's (e.g. --verify-overlap off)


def start_edges(model_dir: Path, device: str, dtype: str, s: Settings) -> dict[str, Edge]:
    """A batched and a --no-batching edge-server of the model (and the variant's batched one), started
    at once (loading an 8B model takes each ~10-30 s), with /metrics; torch threads: the edge's own choice."""
    common = ("--model", str(model_dir), "--device", device, "--dtype", dtype, *EDGE_COMMON, *s.edge_args)
    kinds = {"batched": common, "unbatched": (*common, "--no-batching")}
    if s.variant_args is not None:
        kinds[VARIANT] = (*common, *s.variant_args)
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = {k: pool.submit(Edge, *args, threads=0, metrics=True) for k, args in kinds.items()}
        edges, failed = {}, None
        for kind, future in futures.items():
            try:
                edges[kind] = future.result()
            except Exception as exc:  # noqa: BLE001 - stop the other one, then report
                failed = exc
    if failed is not None:
        for e in edges.values():
            e.stop()
        raise RuntimeError(f"an edge-server did not start: {failed}"[:2000])
    return edges


# ---------------------------------------------------------------------------------- proposals
def proposal_tables(prompts: list[list[int]], paths: list[list[int]], alpha: float, s: Settings, vocab: int,
                    payload_of, seed: int) -> list[PositionTable]:
    """One PositionTable per prompt: at every position the proposal of ``s.draft_max`` tokens, each the
    path's token with probability ``alpha`` (else another), with its packet and drafting time."""
    rng = random.Random(seed)
    step = s.draft_ms / 1e3
    tables = []
    for prompt, path in zip(prompts, paths):
        proposals = {}
        for i in range(len(path)):
            tokens = []
            for right in path[i:i + s.draft_max]:
                tokens.append(right if rng.random() < alpha else (right + 1 + rng.randrange(vocab - 1)) % vocab)
            proposals[i] = Proposal(tokens, [payload_of(t) for t in tokens], [step] * len(tokens))
        tables.append(PositionTable(prompt="", prompt_ids=list(prompt), path=list(path), proposals=proposals,
                                    hello=b"", eos_ids=[], max_new_tokens=len(path)))
    return tables


class Payloads:
    """Each token's packet: the greedy drafter's q is one-hot (TSLT, K = 1), encoded once per token."""

    def __init__(self, codec):
        self.codec, self.cache = codec, {}

    def __call__(self, token: int) -> bytes:
        if token not in self.cache:
            q = torch.zeros(self.codec.vocab_size)
            q[token] = 1.0
            self.cache[token] = encode_distribution(q, self.codec).payload
        return self.cache[token]


# ---------------------------------------------------------------------------------- the run
def run(model_dir: Path, tokenizer, device: str, dtype: str, prompts: list[list[int]], alone: list[list[int]],
        s: Settings, deadline: float, log=print, on_cell=None, out: dict | None = None) -> dict:
    """Start a batched and a --no-batching edge, check the edge's greedy path against ``alone``
    (transformers' greedy generate of the same weights), then measure the cells until ``deadline``;
    Results go into ``out`` (a dict the caller may already hold), and ``on_cell()`` runs after each
    cell (the caller saves what there is)."""
    vocab = len(tokenizer.get_vocab())
    fingerprint = vocab_fingerprint(tokenizer)
    hello = DeviceConfig.of(mode="tslt", top_k=1, draft_len=s.draft_len, temperature=0.0,
                            max_new_tokens=s.tokens).hello(fingerprint, vocab, seed=0)
    hello_none = DeviceConfig.of(mode="none", temperature=0.0, max_new_tokens=s.tokens).hello(fingerprint, vocab, seed=0)
    t0 = time.perf_counter()
    out = {} if out is None else out
    out.update(settings=s.__dict__, cells=[])
    edges: dict[str, Edge] = {}
    try:
        edges = start_edges(model_dir, device, dtype, s)
        addresses = {k: e.address for k, e in edges.items()}
        out["edges_ready_s"] = time.perf_counter() - t0
        log(f"  edges ready in {out['edges_ready_s']:.1f} s")
        edge_paths = _edge_greedy_paths(addresses["batched"], hello_none, prompts, s.tokens)
        out["identity"] = {"edge_only_equals_target_alone": edge_paths == [a[:s.tokens] for a in alone],
                           "prompts": len(prompts)}
        payloads = Payloads(hello.draft.codec(vocab))
        tables = {a: proposal_tables(prompts, edge_paths, a, s, vocab, payloads, seed=int(a * 1000))
                  for a in s.alphas}
        _warm_up(addresses, edges, tables, hello, hello_none, prompts)
        for cell in _cells(s):
            if time.perf_counter() > deadline:
                out["cells"].append({**cell, "skipped": "time budget"})
                continue
            out["cells"].append(_measure(cell, edges, addresses, tables, hello, hello_none, prompts, s))
            log("  " + _line(out["cells"][-1]))
            if on_cell is not None:
                on_cell()
    except Exception as exc:  # noqa: BLE001 - reported in the results, the rest of the check goes on
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"  capacity failed: {out['error']}")
    finally:
        for e in edges.values():
            e.stop()
        out["edge_logs"] = {k: [line.rstrip() for line in list(e.lines)[-20:]] for k, e in edges.items()}
    out["goals"] = goals(out["cells"])
    if s.variant_args is not None:
        out["over_variant"] = over_variant(out["cells"])
    return out


def _edge_greedy_paths(address: str, hello_none, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    clients = [[lambda p=p: EdgeOnlyScript(hello_none, p, (), tokens)] for p in prompts]
    _, results = run_async(replay.run_cell(address, clients, "edge-only"))
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"edge-only path failed: {bad[0]}")
    return [r.ids for r in sorted(results, key=lambda r: r.client)]


def _cells(s: Settings) -> list[dict]:
    """Per N (in ``s.ns`` order): batched and --no-batching at each acceptance, edge-only once; with a
    variant, its batched cells and edge-only right after (the two arms' cells of one N back to back)."""
    out = []
    for n in s.ns:
        for a in s.alphas:
            out += [{"n": n, "mode": "batched", "alpha": a}, {"n": n, "mode": "unbatched", "alpha": a}]
        out.append({"n": n, "mode": "edge-only", "alpha": None})
        if s.variant_args is not None:
            out += [{"n": n, "mode": "batched", "alpha": a, "edge": VARIANT} for a in s.alphas]
            out.append({"n": n, "mode": "edge-only", "alpha": None, "edge": VARIANT})
    return out


def _edge_of(cell: dict) -> str:
    return "unbatched" if cell["mode"] == "unbatched" else cell.get("edge", "batched")


def _clients(cell: dict, tables, hello, hello_none, prompts, tokens: int) -> list[list]:
    if cell["mode"] == "edge-only":
        return [[lambda p=prompts[i % len(prompts)]: EdgeOnlyScript(hello_none, p, (), tokens)]
                for i in range(cell["n"])]
    chosen = tables[cell["alpha"]]
    return [[lambda t=chosen[i % len(chosen)]: GreedyScript(t, hello, tokens)] for i in range(cell["n"])]


def _warm_up(addresses, edges, tables, hello, hello_none, prompts) -> None:
    """First-use costs (kernels, allocators, the slot pool's growth) land here, not in a cell."""
    alpha = next(iter(tables))
    runs = [("batched", "batched"), ("unbatched", "unbatched"), ("edge-only", "batched")]
    runs += [("batched", VARIANT), ("edge-only", VARIANT)] if VARIANT in addresses else []
    for mode, edge in runs:
        clients = _clients({"n": 2, "mode": mode, "alpha": alpha}, tables, hello, hello_none, prompts, WARMUP_TOKENS)
        run_async(replay.run_cell(addresses[edge], clients, "replay" if mode != "edge-only" else "edge-only"))


def _measure(cell: dict, edges, addresses, tables, hello, hello_none, prompts, s: Settings) -> dict:
    """One cell, after the same cell once unmeasured on the batched edge (``cold``: its figures): a
    serving edge captured the CUDA graphs of its batch shapes (~0.2 s each on an ~8B model) long ago,
    and a cell of a few seconds would otherwise mostly time those captures."""
    edge = _edge_of(cell)
    kind = "edge-only" if cell["mode"] == "edge-only" else "replay"
    cold = None
    if edge != "unbatched":
        cold = _run_cell(cell, edges[edge], addresses[edge], kind, tables, hello, hello_none, prompts, s)
    return {**_run_cell(cell, edges[edge], addresses[edge], kind, tables, hello, hello_none, prompts, s),
            "cold": cold and {k: cold[k] for k in ("stats", "batch")}}


def _run_cell(cell: dict, edge, address: str, kind: str, tables, hello, hello_none, prompts, s: Settings) -> dict:
    clients = _clients(cell, tables, hello, hello_none, prompts, s.tokens)
    before = analyze.parse_metrics(edge.metrics() or "")
    t0, results = run_async(replay.run_cell(address, clients, kind))
    after = analyze.parse_metrics(edge.metrics() or "")
    sessions = [r.to_json(t0) for r in results]
    stats = analyze.cell_stats(sessions, cell["n"], s.tokens)
    return {**cell, "stats": stats, "batch": analyze.batch_stats(before, after),
            "divergences": sum(1 for x in sessions if x["divergence"]), "errors": [x["error"] for x in sessions if x["error"]][:3],
            "acceptance": _acceptance(sessions)}


def _acceptance(sessions: list[dict]) -> float | None:
    drafted = sum(x["drafted"] for x in sessions)
    return sum(x["accepted"] for x in sessions) / drafted if drafted else None


def _line(c: dict) -> str:
    st, b = c.get("stats", {}), c.get("batch", {})
    alpha = f" a={c['alpha']}" if c["alpha"] is not None else ""
    alpha += f" ({c['edge']})" if c.get("edge") else ""
    batch = f", {b['mean_sessions']:.1f} sessions/{b['mean_tokens']:.0f} tokens per forward" if b.get("available") else ""
    if b.get("static_forwards"):
        g = b.get("graphs", {})
        batch += (f", {b['mean_forward_s'] * 1e3:.1f} ms a forward, {b.get('verify_s', 0.0):.2f} s verifying in "
                  f"{st.get('window_s', 0.0):.2f} s, {b['static_forwards']:.0f} static: graphs "
                  f"{g.get('captured', 0):.0f} captured / {g.get('replayed', 0):.0f} replayed / {g.get('failed', 0):.0f} failed")
    tps = st.get("aggregate_tps")
    cold = (c.get("cold") or {}).get("stats", {}).get("aggregate_tps")
    batch += f" (cold: {cold:.1f} tok/s)" if cold is not None else ""
    return (f"N={c['n']:<3} {c['mode']:<10}{alpha:<7} {tps if tps is None else round(tps, 1)} tok/s"
            f"{batch}" + (f", {c['divergences']} divergences" if c.get("divergences") else "")
            + (f", errors {c['errors']}" if c.get("errors") else ""))


def _tps(cells: list[dict], n: int, mode: str, alpha: float | None, edge: str | None = None) -> float | None:
    for c in cells:
        if c["n"] == n and c["mode"] == mode and c["alpha"] == alpha and c.get("edge") == edge and "stats" in c:
            return c["stats"].get("aggregate_tps")
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(cells: list[dict], n: int = 32, alpha: float = 0.8) -> dict:
    """The issue's capacity goals at N = 32, acceptance 0.8: batched >= 10x --no-batching, >= 3x edge-only."""
    batched = _tps(cells, n, "batched", alpha)
    return {"batched_over_unbatched": {"value": _ratio(batched, _tps(cells, n, "unbatched", alpha)), "goal": 10.0},
            "batched_over_edge_only": {"value": _ratio(batched, _tps(cells, n, "edge-only", None)), "goal": 3.0},
            "where": f"N = {n}, acceptance {alpha}"}


def over_variant(cells: list[dict]) -> dict[str, dict[str, float | None]]:
    """The A/B: by N, the first arm's tokens/s over the variant's, batched (by acceptance) and edge-only."""
    out: dict[str, dict[str, float | None]] = {}
    for n in sorted({c["n"] for c in cells if c.get("edge") == VARIANT}):
        pairs = [(f"batched a={c['alpha']}", "batched", c["alpha"]) for c in cells
                 if c["n"] == n and c.get("edge") == VARIANT and c["mode"] == "batched"]
        out[str(n)] = {name: _ratio(_tps(cells, n, mode, a), _tps(cells, n, mode, a, VARIANT))
                       for name, mode, a in [*pairs, ("edge-only", "edge-only", None)]}
    return out


def dump(obj) -> str:
    return json.dumps(obj, default=str)
