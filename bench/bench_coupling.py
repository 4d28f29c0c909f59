"""Benchmark: acceptance per draft position against uplink bits per position, on the real pair.

Every mode buys acceptance with bits. DSSD sends the exact q's acceptance, 1 - TV(p, q), for an id
and a float64 q(x); TSLT and K-SQS send a truncated (and quantized) q and lose acceptance with it;
dense sends all of q; gumbel sends the id alone and keeps a draft iff it is the target's own race with
the shared noise, which happens with probability between (1 - TV) / (1 + TV) (Daliri, Musco and
Suresh, arXiv 2408.07978, Theorem 2) and 1 - TV. This measures each on the same positions: texts the
target samples (greedy at T = 0) from the bench prompts, the drafter's q and the target's p after the
same prefix at every generated position, exactly (no sampling noise) where a closed form exists:

  * codecs (dense, TSLT K, K-SQS (K, l)): the device drafts from the decoded packet q_hat, accepted
    with probability sum_x min(p, q_hat) (bench_truncation.acceptance); bits = the draft id at
    ceil(log2 V) bits + the packet as serialized (and the papers' theoretical count);
  * DSSD: 1 - TV(p, q); bits = the id + 64 (q(x) as float64);
  * gumbel: P(argmin_v E(v) / p(v) = argmin_v E(v) / q(v)) over the noise, exactly
    (:func:`race_agreement`), and as the product's own code path draws it with each of ``--seeds``
    session seeds (q with the target's filters, the position's token noise); bits = the id alone;
  * the coupling bound (1 - TV) / (1 + TV) and 1 - TV of the same positions; for gumbel trees, how
    often the target's draw is among the k first of the drafter's race (Monte Carlo, ``--tree-draws``
    noise draws a position): a tree of branching k at each depth would accept that often.

    .venv/bin/python -m specdec.bench.bench_coupling [--temperatures 0,1] [--prompts 6] [--max-new-tokens 64]
    .venv/bin/python -m specdec.bench.bench_coupling --replot results/bench_coupling.json

Writes results/bench_coupling.json and results/bench_coupling.png (``--out``: the JSON's path, the
figure beside it) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from specdec.bench import bench_truncation as bt
from specdec.bench.harness.plan import RESULTS, git_info
from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.codecs import CodecConfig
from specdec.common.distributions import race_token, tv_distance
from specdec.common.idpack import id_bits
from specdec.common.modes import Mode
from specdec.common.settings import DraftSettings
from specdec.common.verification import token_noise
from specdec.device.draft_model import encode_q

# (name, mode, K, lattice): dense, TSLT over K, K-SQS over (K, lattice)
CODECS = ([("dense-fp16", Mode.DENSE, None, 1000)]
          + [(f"tslt-{k}", Mode.TSLT, k, 1000) for k in (1, 4, 16, 64, 256, 1024)]
          + [(f"ksqs-{k}-l{lat}", Mode.KSQS, k, lat) for k in (16, 64, 256) for lat in (10, 100, 1000)]
          + [("ksqs-1024-l1000", Mode.KSQS, 1024, 1000)])
DSSD_SCALAR_BITS = 64          # q(x) as float64 (codecs.encode_dssd_scalars)
TREE_BRANCHING = (1, 2, 4)     # k: the target's draw among the drafter's k first (k = 1: the chain)
WIRE_DRAFT_LENS = (1, 4, 8)    # whole Draft messages of gumbel rounds, serialized, per draft position


def race_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmin_v E(v)/p(v) == argmin_v E(v)/q(v)) for i.i.d. exponential E, exactly: both races pick
    token i iff E_j > E_i max(p_j/p_i, q_j/q_i) for every j, which given E_i has probability
    exp(-E_i sum_{j != i} max(...)); integrating over E_i gives 1 / sum_j max(p_j/p_i, q_j/q_i). With
    r_j = p_j / q_j the max is p_j/p_i where r_j >= r_i and q_j/q_i elsewhere, so the sum is
    P(r >= r_i) / p_i + Q(r < r_i) / q_i: prefix sums over tokens sorted by r, O(V log V).

    Args:
        p, q: [V] float64 probabilities.
    """
    p, q = p.double(), q.double()
    both = (p > 0) & (q > 0)
    live = (p > 0) | (q > 0)
    r = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, math.inf))[live]  # [n]
    order = torch.argsort(r)
    r_sorted, p_sorted, q_sorted = r[order], p[live][order], q[live][order]
    p_suffix = torch.flip(torch.cumsum(torch.flip(p_sorted, [0]), 0), [0])  # [n] sum of p over r >= r_k
    q_prefix = torch.cumsum(q_sorted, 0) - q_sorted                          # [n] sum of q over index < k
    r_i = torch.where(q > 0, p / q.clamp_min(1e-300), torch.zeros_like(p))[both]
    first = torch.searchsorted(r_sorted, r_i, right=False)  # first index with r >= r_i (ties together)
    total = p_suffix[first] / p[both] + q_prefix[first] / q[both]
    return float((1.0 / total).sum())


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temperatures", default="0,1", help="comma-separated, e.g. 0,1")
    ap.add_argument("--prompts", type=int, default=6, help="first N prompts of bench/prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=8, help="session seeds whose noise draws gumbel's drafts")
    ap.add_argument("--tree-draws", type=int, default=16, help="noise draws a position for the tree coverage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        a.temperatures = [float(t) for t in a.temperatures.split(",") if t]
    except ValueError:
        ap.error(f"--temperatures must be numbers, got {a.temperatures!r}")
    if not a.temperatures or any(not math.isfinite(t) or t < 0 for t in a.temperatures):
        ap.error("--temperatures must be finite and >= 0")
    if min(a.prompts, a.max_new_tokens, a.seeds, a.tree_draws) < 1:
        ap.error("--prompts, --max-new-tokens, --seeds and --tree-draws must be >= 1")
    return a


class Sums:
    """Per-series sums over positions: acceptance, bits as serialized and theoretical."""

    def __init__(self):
        self.series: dict[str, dict] = {}

    def add(self, name: str, family: str, acceptance: float, bits: float, theoretical: float | None = None) -> None:
        s = self.series.setdefault(name, {"family": family, "acceptance": 0.0, "bits": 0.0, "theoretical_bits": 0.0,
                                          "n": 0})
        s["acceptance"] += acceptance
        s["bits"] += bits
        s["theoretical_bits"] += bits if theoretical is None else theoretical
        s["n"] += 1

    def means(self) -> dict:
        return {name: {"family": s["family"], "acceptance": s["acceptance"] / s["n"],
                       "bits_per_position": s["bits"] / s["n"],
                       "theoretical_bits_per_position": s["theoretical_bits"] / s["n"]}
                for name, s in self.series.items()}


def measure_temperature(target, drafter, prompts, temperature: float, a) -> dict:
    V = drafter.vocab_size
    width = id_bits(V)
    codecs = {name: CodecConfig(mode=mode, vocab_size=V, top_k=k, lattice=lat, dense_dtype="fp16")
              for name, mode, k, lat in CODECS}
    sums = Sums()
    tv_sum = bound_sum = exact_sum = drawn = below = 0.0
    n = 0
    tree_hits = {k: 0 for k in TREE_BRANCHING}
    gen = torch.Generator().manual_seed(a.seed)
    for p, q in bt.positions(target, drafter, prompts, temperature, a.max_new_tokens):
        tv = tv_distance(p, q)
        bound = (1 - tv) / (1 + tv)
        exact = race_agreement(p, q)
        below += exact < bound - 1e-9
        tv_sum, bound_sum, exact_sum = tv_sum + tv, bound_sum + bound, exact_sum + exact
        sums.add("gumbel", "gumbel", exact, width)
        sums.add("dssd", "dssd", 1 - tv, width + DSSD_SCALAR_BITS)
        for name, codec in codecs.items():
            enc = encode_q(q, codec)
            sums.add(name, codec.mode.value, bt.acceptance(p, enc.q_hat), width + 8 * len(enc.payload),
                     width + enc.theoretical_bits)
        # the product's own draws: the position's noise of each session seed (T = 0: one-hot, no noise)
        for seed in range(a.seeds):
            e = token_noise(seed, n, V) if temperature > 0 else torch.ones(V, dtype=torch.float64)
            drawn += race_token(q, e) == race_token(p, e)
        if temperature > 0:
            _tree_coverage(p, q, a.tree_draws, gen, tree_hits)
        n += 1
    draws = n * a.seeds
    rate = drawn / draws
    return {
        "temperature": temperature, "positions": n, "series": sums.means(),
        "tv": tv_sum / n, "one_minus_tv": 1 - tv_sum / n, "coupling_bound": bound_sum / n,
        "gumbel_exact": exact_sum / n, "positions_below_bound": int(below),
        "gumbel_drawn": {"rate": rate, "draws": draws, "stderr": math.sqrt(rate * (1 - rate) / draws)},
        "gumbel_tv_factor": (1 - exact_sum / n) / (tv_sum / n) if tv_sum else None,
        "tree_coverage": ({str(k): hits / (n * a.tree_draws) for k, hits in tree_hits.items()}
                          if temperature > 0 else {str(k): exact_sum / n for k in TREE_BRANCHING}),
    }


def _tree_coverage(p: torch.Tensor, q: torch.Tensor, draws: int, gen: torch.Generator, hits: dict) -> None:
    """For each noise draw: is the target's race among the k first of the drafter's race?"""
    e = -torch.log(torch.rand(draws, p.numel(), dtype=torch.float64, generator=gen))  # [draws, V]
    y = (e / p).argmin(dim=1)                                                          # [draws]
    order = (e / q).argsort(dim=1)[:, :max(TREE_BRANCHING)]                            # [draws, k]
    for k in TREE_BRANCHING:
        hits[k] += int((order[:, :k] == y.unsqueeze(1)).any(dim=1).sum())


def wire_bytes(vocab_size: int) -> dict:
    """Serialized bytes per draft position of a gumbel round's Draft: the packed ids alone, and the whole
    message (its DeviceMessage framing, the round id, the width; with the round's settings, as mode auto
    sends them, and without, as a session of mode gumbel sends its rounds)."""
    out = {}
    width = id_bits(vocab_size)
    for L in WIRE_DRAFT_LENS:
        ids = tuple((vocab_size - 1 - 7919 * i) % vocab_size for i in range(L))  # large ids: the worst case
        plain = P.DraftBlock(round_id=100, token_ids=ids, id_bits=width)
        with_settings = P.DraftBlock(round_id=100, token_ids=ids, id_bits=width,
                                     settings=DraftSettings(mode=Mode.GUMBEL, draft_len=L))
        out[f"L{L}"] = {"payload": len(wire.draft_to_pb(plain).draft.packed_ids) / L,
                        "message": wire.draft_to_pb(plain).ByteSize() / L,
                        "message_with_settings": wire.draft_to_pb(with_settings).ByteSize() / L,
                        "tslt_style_ids": wire.draft_to_pb(P.DraftBlock(round_id=100, token_ids=ids)).ByteSize() / L}
    return out


def noise_seconds(vocab_size: int, repeats: int = 50) -> float:
    """One position's noise (the cost each side pays per raced position)."""
    t0 = time.perf_counter()
    for i in range(repeats):
        token_noise(0, i, vocab_size)
    return (time.perf_counter() - t0) / repeats


def measure(a: argparse.Namespace) -> dict:
    target, drafter, prompts = bt.load_pair_and_prompts(a)
    res = {"drafter": drafter.name, "target": target.name, "vocab_size": drafter.vocab_size,
           "id_bits": id_bits(drafter.vocab_size), "wire_bytes_per_position": wire_bytes(drafter.vocab_size),
           "noise_seconds_per_position": noise_seconds(drafter.vocab_size), "temperatures": {}}
    for t in a.temperatures:
        res["temperatures"][f"{t:g}"] = measure_temperature(target, drafter, prompts, t, a)
    return res


def plot(res: dict, path: Path) -> Path:
    """Acceptance against bits (log axis), one panel per temperature, one colour per family (a line
    through TSLT's K and each K-SQS K's lattices), the coupling bound and 1 - TV of the same positions."""
    from specdec.bench.harness import plots
    plt = plots.plt
    temps = list(res["temperatures"].values())
    fig, axes = plt.subplots(1, len(temps), figsize=(5.6 * len(temps), 4.4), squeeze=False)
    for ax, r in zip(axes[0], temps):
        spread = r["temperature"] > 0  # at T = 0 every mode accepts alike: a label per family only
        labelled = set()
        for name, s in sorted(r["series"].items(), key=lambda kv: kv[1]["bits_per_position"]):
            fam, star = s["family"], s["family"] == "gumbel"
            ax.scatter(s["bits_per_position"], s["acceptance"], color=plots.MODE_COLOURS.get(fam, "black"),
                       s=110 if star else 26, marker="*" if star else "o", zorder=3,
                       label=None if fam in labelled else fam)
            labelled.add(fam)
            if spread or star or fam in ("dssd", "dense"):
                ax.annotate(name, (s["bits_per_position"], s["acceptance"]), fontsize=6, xytext=(3, -8 if star else 2),
                            textcoords="offset points")
        for fam, key in (("tslt", lambda n: "tslt"), ("ksqs", lambda n: n.rsplit("-l", 1)[0])):
            lines: dict[str, list] = {}
            for name, s in r["series"].items():
                if s["family"] == fam:
                    lines.setdefault(key(name), []).append((s["bits_per_position"], s["acceptance"]))
            for pts in lines.values():
                ax.plot(*zip(*sorted(pts)), color=plots.MODE_COLOURS[fam], lw=0.7, alpha=0.5)
        ax.axhline(r["one_minus_tv"], color="black", ls="--", lw=0.8, label=f"1 - TV = {r['one_minus_tv']:.4f}")
        ax.axhline(r["coupling_bound"], color="tab:orange", ls=":", lw=1.0,
                   label=f"(1 - TV) / (1 + TV) = {r['coupling_bound']:.4f}")
        ax.set_xscale("log")
        ax.set_xlabel("uplink bits per draft position (the id + q's packet, as serialized)")
        ax.set_ylabel("acceptance per draft position")
        ax.set_title(f"T = {r['temperature']:g}: {r['positions']} positions; gumbel {r['gumbel_exact']:.4f}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    note = (f"make bench-coupling: {res['target']} target, {res['drafter']} drafter, {res['prompts']} prompts x "
            f"{res['max_new_tokens']} tokens; exact expectations per position; rev {res.get('git', {}).get('revision', '')[:10]}")
    return plots.save(fig, path, note)


def report(res: dict) -> None:
    for key, r in res["temperatures"].items():
        d = r["gumbel_drawn"]
        print(f"T = {key}: {r['positions']} positions; 1 - TV {r['one_minus_tv']:.4f}, bound {r['coupling_bound']:.4f}, "
              f"gumbel exact {r['gumbel_exact']:.4f} (drawn {d['rate']:.4f} +- {d['stderr']:.4f} over {d['draws']}), "
              f"{r['positions_below_bound']} positions below the bound; tree coverage {r['tree_coverage']}")
        for name, s in sorted(r["series"].items(), key=lambda kv: kv[1]["bits_per_position"]):
            print(f"  {name:16s} {s['bits_per_position']:10.1f} bits  acceptance {s['acceptance']:.4f}")
    w = res["wire_bytes_per_position"]
    print("gumbel Draft bytes per position: " + ", ".join(
        f"{k}: payload {v['payload']:.2f}, message {v['message']:.2f} ({v['message_with_settings']:.2f} with settings)"
        for k, v in w.items()))
    print(f"noise per position: {res['noise_seconds_per_position'] * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--replot"]:  # --replot RESULT.json: the figure and the table again, nothing measured
        res = json.loads(Path(argv[1]).read_text())
        report(res)
        print(f"wrote {plot(res, Path(argv[1]).with_suffix('.png'))}")
        return 0
    a = _args(argv)
    t0, git = time.perf_counter(), git_info()  # the revision measured, before anything can move it
    res = measure(a)
    res.update(prompts=a.prompts, max_new_tokens=a.max_new_tokens, seeds=a.seeds, tree_draws=a.tree_draws,
               machine=platform.platform(), torch=torch.__version__, git=git,
               seconds=time.perf_counter() - t0)
    out = a.out or RESULTS / "bench_coupling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    report(res)
    print(f"wrote {out} and {plot(res, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
