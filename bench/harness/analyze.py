"""What every benchmark computes alike from its session records: sums over sessions (:class:`Agg`),
ratios, percentiles, geometric means, goals with their verdicts and how they print. Pure (no I/O
but printing).

Definitions used throughout:
  * acceptance alpha = accepted draft positions / drafted positions (tree: accepted depth / depth);
  * tokens/s = generated tokens / wall seconds over a set of sessions (prefill and Hello included,
    as a user sees them);
  * a goal passes when its value measured in this run reaches its threshold (at most, for goals
    where less is better); None where the run could not measure it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def fmt(x, spec=".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def ratio(a, b):
    """a / b for numbers with b > 0, else None (a missing config, an empty cell)."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no data."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def goal(text: str, value, threshold: float, where: str = "", detail=None, at_most: bool = False) -> dict:
    """One goal of a benchmark: what it asks, what this run measured, and the verdict."""
    if value is None:
        verdict = None
    else:
        verdict = value <= threshold if at_most else value >= threshold
    return {"goal": text, "value": value, "threshold": threshold, "where": where, "detail": detail,
            "pass": verdict}


def print_goals(title: str, goals: dict, detail=None) -> None:
    """The goals with PASS / MISS, one line each; ``detail(goal)``: an optional line under one."""
    print(f"\n{title}")
    for g in goals.values():
        verdict = "n/a" if g["pass"] is None else ("PASS" if g["pass"] else "MISS")
        where = f"; {g['where']}" if g.get("where") else ""
        print(f"  [{verdict:>4}] {g['goal']}: measured {fmt(g['value'], '.3g')} (threshold {g['threshold']}{where})")
        line = detail(g) if detail else None
        if line:
            print(f"         {line}")


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
            agg.add(s["record"], s.get("extra", {}))
    return agg
