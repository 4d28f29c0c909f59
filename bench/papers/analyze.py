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

import math
from dataclasses import dataclass, field

from specdec.common.latency import expected_tokens_per_call, oracle_time_drafting_ahead


@dataclass
class Agg:
    sessions: int = 0
    tokens: int = 0
    wall: float = 0.0
    rounds: int = 0
    positions: int = 0
    accepted: int = 0
    draft_tokens: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    theo_bits: int = 0
    draft_s: float = 0.0
    encode_s: float = 0.0
    net_s: float = 0.0
    verify_s: float = 0.0
    rejected_rounds: int = 0
    fallbacks: int = 0
    ahead_rounds: int = 0       # rounds whose drafting began while the edge verified the previous one
    sigma: list[float] = field(default_factory=list)
    support: list[int] = field(default_factory=list)

    def add(self, record: dict, extra: dict) -> None:
        s = record["stats"]
        self.sessions += 1
        self.tokens += s["generated_tokens"]
        self.wall += s["wall_seconds"]
        self.rounds += s["rounds"]
        self.positions += s["draft_positions"]
        self.accepted += s["accepted_tokens"]
        self.draft_tokens += s["draft_tokens"]
        self.up_bytes += s["uplink_bytes"]
        self.down_bytes += s["downlink_bytes"]
        self.theo_bits += s["theoretical_uplink_bits"]
        self.draft_s += s["time"]["draft"]
        self.encode_s += s["time"]["encode"]
        self.net_s += s["time"]["network"]
        self.verify_s += s["time"]["verify"]
        self.fallbacks += s.get("dssd_fallbacks", 0)
        self.ahead_rounds += s.get("draft_ahead", {}).get("rounds_used", 0)
        self.rejected_rounds += sum(1 for pos, acc in extra.get("rounds", []) if acc < pos)
        self.sigma += extra.get("sigma", [])
        self.support += extra.get("support", [])

    # -- derived ---------------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        return self.accepted / self.positions if self.positions else float("nan")

    @property
    def alpha_se(self) -> float:
        """Binomial standard error over drafted positions (ignores correlation within a session)."""
        a = self.alpha
        return math.sqrt(a * (1 - a) / self.positions) if self.positions else float("nan")

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else float("nan")

    def per_round(self, value: float) -> float:
        return value / self.rounds if self.rounds else float("nan")

    def per_token(self, value: float) -> float:
        return value / self.tokens if self.tokens else float("nan")

    @property
    def t_slm(self) -> float:
        return (self.draft_s + self.encode_s) / self.positions if self.positions else float("nan")

    @property
    def draft_ahead_hit_rate(self) -> float:
        return self.ahead_rounds / self.rounds if self.rounds else 0.0

    @property
    def sigma_mean(self) -> float:
        return sum(self.sigma) / len(self.sigma) if self.sigma else float("nan")

    def row(self) -> dict:
        return {
            "sessions": self.sessions, "tokens": self.tokens, "wall_s": self.wall, "tokens_per_s": self.tps,
            "rounds": self.rounds, "draft_positions": self.positions, "accepted": self.accepted,
            "acceptance": self.alpha, "acceptance_se": self.alpha_se,
            "mean_accepted_length": self.per_round(self.accepted),
            "tokens_per_round": self.per_round(self.tokens),
            "uplink_bytes_per_token": self.per_token(self.up_bytes),
            "downlink_bytes_per_token": self.per_token(self.down_bytes),
            "uplink_bytes_per_round": self.per_round(self.up_bytes),
            "downlink_bytes_per_round": self.per_round(self.down_bytes),
            "theoretical_uplink_bits_per_token": self.per_token(self.theo_bits),
            "t_slm_s": self.t_slm, "t_verify_s": self.per_round(self.verify_s),
            "draft_s_per_round": self.per_round(self.draft_s), "encode_s_per_round": self.per_round(self.encode_s),
            "network_s_per_round": self.per_round(self.net_s),
            "resampling_rate": self.per_round(self.rejected_rounds),
            "sigma_mean": self.sigma_mean,
            "support_mean": sum(self.support) / len(self.support) if self.support else float("nan"),
            "dssd_fallbacks": self.fallbacks,
            "draft_ahead_hit_rate": self.draft_ahead_hit_rate,
        }


def aggregate(sessions: list[dict], where=lambda s: True) -> Agg:
    agg = Agg()
    for s in sessions:
        if where(s):
            agg.add(s["record"], s["extra"])
    return agg


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


def finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
