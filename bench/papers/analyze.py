"""From session records to the figures' numbers: sums per point, speedups, the oracle model, the bound.

Definitions (all from the same run):
  * acceptance alpha = accepted draft positions / drafted positions (tree: accepted depth / depth);
  * tokens/s = generated tokens / wall seconds over a point's sessions (prefill included);
  * speedup = a point's tokens/s / the target alone's tokens/s on the same prompts, seeds and token
    count, run right after the point (the shared cores' speed drifts with the other processes on
    them, so each point gets its own adjacent baseline);
  * resampling rate (SQS Fig. 2) = rounds that ended in a rejection / rounds;
  * sigma = probability mass of the drafter's q outside the transmitted support (TSLT Thm. 1), per
    encoded distribution; E[sigma] its mean over the point.
Oracle-call model (TSLT eq. 5, 8, 10 for chains; eq. 26-28 for trees), per config from its rate-curve
sessions pooled over links: T_SLM = (draft + encode seconds) / drafted positions, T_V = edge verify
seconds / rounds, uplink bits per round from the serialized bytes; T_comm = bits / rate; the target
alone's time per token T_LLM = 1 / its tokens/s (the median of all the run's baselines). Predicted
speedup = N T_LLM / (L T_SLM + T_comm + T_V) with N = eq. 8 (chain) or L alpha + 1 (tree, eq. 28).
The paper takes T_V = T_LLM; we use the measured verify time of a round (one forward over L + 1 or
|tree| + 1 tokens, plus payload decode).
"""
from __future__ import annotations

from specdec.bench.harness.analyze import Agg
from specdec.device.latency import expected_tokens_per_call, oracle_time_drafting_ahead


def depth(shape: str, draft_len: int, tree: tuple[int, ...]) -> int:
    return len(tree) if shape == "tree" else draft_len


def predicted_speedup(agg: Agg, shape: str, draft_len: int, tree: tuple[int, ...], rate_bps: float,
                      down_rate_bps: float, target_tps: float) -> float:
    """TSLT eq. 5/8/10 (chain) or 26-28 (tree) from measured parts; rate 0 = no link time.

    Eq. 5 is extended to the device drafting round r + 1 while round r is verified, with the
    measured share of rounds whose early drafting was kept (latency.oracle_time_drafting_ahead;
    a share of 0, as for trees, C-SQS and DSSD, is eq. 5 itself)."""
    if not agg.rounds or not agg.positions or not (target_tps > 0):
        return float("nan")
    L = depth(shape, draft_len, tree)
    alpha = min(1.0, max(0.0, agg.alpha))
    n_tokens = L * alpha + 1.0 if shape == "tree" else expected_tokens_per_call(alpha, L)
    t_comm = 0.0
    if rate_bps > 0:
        t_comm += agg.per_round(8 * agg.up_bytes) / rate_bps
    if down_rate_bps > 0:
        t_comm += agg.per_round(8 * agg.down_bytes) / down_rate_bps
    t_oracle = oracle_time_drafting_ahead(L, agg.t_slm, t_comm, agg.per_round(agg.verify_s),
                                          agg.draft_ahead_hit_rate)
    return n_tokens * (1.0 / target_tps) / t_oracle


def topk_mass_curve(sessions: list[dict], grid: list[int]) -> list[dict]:
    """Mean and 10/50/90th percentiles of the drafter's top-K mass over all recorded draft steps."""
    steps = [row for s in sessions for row in s["extra"].get("topk_mass", [])]
    out = []
    for j, k in enumerate(grid):
        vals = sorted(row[j] for row in steps)
        if not vals:
            continue
        q = lambda f: vals[min(len(vals) - 1, int(f * (len(vals) - 1) + 0.5))]  # noqa: E731
        out.append({"K": k, "steps": len(vals), "mean": sum(vals) / len(vals), "p10": q(0.1), "p50": q(0.5),
                    "p90": q(0.9)})
    return out
