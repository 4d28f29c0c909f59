"""What bench-links runs: the link cells, the configurations, and the interleaved jobs of a cell. Pure.

A *link* is uplink rate x round trip (one-way delay RTT/2 each way), optionally with jitter or loss.
The downlink runs at DOWN_FACTOR x the uplink: access links (LTE, cable, most Wi-Fi) are faster down
than up, and the downlink carries only verdicts (tens of bytes) and streamed tokens, so its rate
hardly matters except for DSSD's rare full-distribution fallback; the grid varies the uplink, which
carries the drafts. A *cell* is a link at one temperature. Every configuration of a cell runs the
same prompts with the same seeds, interleaved prompt by prompt (the order of the configurations
changes from one prompt to the next, balanced for carryover: harness.plan.balanced), so slow drift of
the shared cores and what one session leaves behind hit all alike.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.bench.harness.plan import SEED_BASE, interleave

DOWN_FACTOR = 4.0             # downlink rate = 4 x uplink (see the module doc)
DEFAULT_CONFIG = "tslt256-L4"  # today's fixed default: TSLT K = 256, L = 4 (the default drafter's point)
# A configuration is skipped in a cell when its uplink alone, at the bytes per token it sent in an
# earlier cell of the same temperature, would take more than PRUNE_FACTOR x the edge-only time per
# token there: it cannot be the cell's best (< 1/PRUNE_FACTOR of edge-only) and would eat the budget
# (dense fp16 sends ~100 KB per position: ~6 s per round at 0.5 Mbit/s).
PRUNE_FACTOR = 4.0

# name -> (role, DeviceConfig overrides). Roles: none (edge-only), fixed, auto, control (edge-only run
# a second time beside the first: what the host alone moves a ratio, bench-traces --control).
CONFIGS: dict[str, tuple[str, dict]] = {
    "none": ("none", {"mode": "none"}),
    "tslt256-L4": ("fixed", {"mode": "tslt", "top_k": 256, "draft_len": 4}),
    "tslt64-L6": ("fixed", {"mode": "tslt", "top_k": 64, "draft_len": 6}),
    "tslt256-L8": ("fixed", {"mode": "tslt", "top_k": 256, "draft_len": 8}),
    "dense-L4": ("fixed", {"mode": "dense", "dense_dtype": "fp16", "draft_len": 4}),
    "ksqs64-L4": ("fixed", {"mode": "ksqs", "top_k": 64, "lattice": 1000, "draft_len": 4}),
    "dssd-L4": ("fixed", {"mode": "dssd", "draft_len": 4}),
    "gumbel-L4": ("fixed", {"mode": "gumbel", "draft_len": 4}),
    "gumbel-L8": ("fixed", {"mode": "gumbel", "draft_len": 8}),
    "auto": ("auto", {"mode": "auto"}),
    "edge-only-again": ("control", {"mode": "none"}),
    # mode auto without gumbel among its candidates (its own memory of the link): the A/B of issue 37
    "auto-nogumbel": ("auto", {"mode": "auto", "auto_config": {"gumbel": False}}),
    # mode auto free to choose any round (factory.DeviceConfig.reproducible off, as for a daemon request
    # without a seed): the A/B of issue 44 against "auto", a seeded session that keeps to race rounds
    "auto-free": ("auto", {"mode": "auto", "reproducible": False}),
}
FULL_CONFIGS = ("none", "tslt256-L4", "tslt64-L6", "tslt256-L8", "dense-L4", "ksqs64-L4", "dssd-L4", "gumbel-L4",
                "auto")
QUICK_CONFIGS = ("none", "tslt256-L4", "tslt64-L6", "dssd-L4", "auto")


@dataclass(frozen=True)
class Link:
    name: str
    up_mbit: float
    rtt_ms: float
    jitter_ms: float = 0.0     # each direction, uniform +-
    loss: float = 0.0          # each direction, per segment
    kind: str = "grid"         # grid | jitter | loss

    @property
    def up_bps(self) -> float:
        return self.up_mbit * 1e6

    @property
    def down_bps(self) -> float:
        return self.up_mbit * 1e6 * DOWN_FACTOR

    def emulator(self, with_rate: bool = False) -> dict:
        """The emulator's control message for this link (delay, jitter, loss; the rate too if asked)."""
        one_way = {"delay_s": self.rtt_ms / 2e3, "jitter_s": self.jitter_ms / 1e3, "loss": self.loss}
        return {"uplink": {**one_way, "rate_bps": self.up_bps if with_rate else 0.0},
                "downlink": {**one_way, "rate_bps": self.down_bps if with_rate else 0.0}}


def link_name(up_mbit: float, rtt_ms: float, jitter_ms: float = 0.0, loss: float = 0.0) -> str:
    name = f"{up_mbit:g}mbit-{rtt_ms:g}ms"
    if jitter_ms:
        name += f"-j{jitter_ms:g}ms"
    if loss:
        name += f"-loss{loss * 100:g}%"
    return name


def grid_link(up: float, rtt: float, jitter: float = 0.0, loss: float = 0.0) -> Link:
    kind = "jitter" if jitter else "loss" if loss else "grid"
    return Link(link_name(up, rtt, jitter, loss), up, rtt, jitter, loss, kind)


@dataclass(frozen=True)
class Phase:
    at_s: float               # seconds after the config's run starts
    link: Link


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    rates_mbit: tuple[float, ...] = (100.0, 10.0, 2.0, 0.5)
    rtts_ms: tuple[float, ...] = (0.0, 20.0, 60.0, 150.0)
    # (up Mbit/s, RTT ms, jitter ms, loss): jitter and loss at a mid link (10 Mbit/s, 60 ms) and a slow
    # short one (2 Mbit/s, 20 ms)
    variants: tuple[tuple[float, float, float, float], ...] = (
        (10.0, 60.0, 10.0, 0.0), (10.0, 60.0, 0.0, 0.01), (2.0, 20.0, 10.0, 0.0), (2.0, 20.0, 0.0, 0.01))
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompts: int = 2
    max_new_tokens: int = 96
    configs: tuple[str, ...] = FULL_CONFIGS
    # The changing link: 100 Mbit/s 5 ms -> 1 Mbit/s 100 ms -> back, at these seconds of each run.
    change_at_s: tuple[float, float] = (8.0, 23.0)
    change_end_s: float = 33.0          # no new session starts after this; the analysis window ends here
    change_prompts: int = 6             # back-to-back sessions (a session that ends early is followed)
    change_max_new_tokens: int = 256
    only_cells: tuple[str, ...] = ()    # link names (substring match) to run; () = all
    changing: bool = True

    @classmethod
    def preset(cls, quick: bool) -> "Settings":
        if not quick:
            return cls()
        return cls(quick=True, rates_mbit=(10.0, 0.5), rtts_ms=(0.0, 60.0), variants=((10.0, 60.0, 0.0, 0.01),),
                   temperatures=(1.0,), prompts=1, max_new_tokens=32, configs=QUICK_CONFIGS,
                   change_at_s=(4.0, 10.0), change_end_s=14.0, change_prompts=3, change_max_new_tokens=128)

    def to_json(self) -> dict:
        return asdict(self)


def links(s: Settings) -> list[Link]:
    """Grid links (fast to slow, then by RTT), then the jitter / loss variants."""
    out = [grid_link(r, t) for r in sorted(s.rates_mbit, reverse=True) for t in sorted(s.rtts_ms)]
    out += [grid_link(*v) for v in s.variants]
    if s.only_cells:
        out = [link for link in out if any(pat in link.name for pat in s.only_cells)]
    return out


def changing_phases(s: Settings) -> list[Phase]:
    fast, slow = grid_link(100.0, 5.0), grid_link(1.0, 100.0)
    return [Phase(0.0, fast), Phase(s.change_at_s[0], slow), Phase(s.change_at_s[1], fast)]


@dataclass
class Job:
    id: str
    cell: str
    config: str
    prompt: int
    temperature: float
    max_new_tokens: int
    device: dict = field(default_factory=dict)

    def to_driver(self, prompts: list[str], seeds_from: int = SEED_BASE, budget_s: float = float("inf"),
                  count: int = 1) -> dict:
        idx = list(range(self.prompt, self.prompt + count))
        return {"id": self.id, "config": {**self.device, "temperature": self.temperature,
                                          "max_new_tokens": self.max_new_tokens},
                "prompts": [prompts[i % len(prompts)] for i in idx], "seeds": [seeds_from + i for i in idx],
                "budget_s": budget_s, "extras": ["timeline"]}


def cell_name(link: str, temperature: float) -> str:
    return f"{link}@T{temperature:g}"


def config_device(name: str, extra: dict | None = None) -> dict:
    return {**CONFIGS[name][1], **(extra or {})}


def cell_jobs(link: str, temperature: float, configs: list[str], prompts: int, max_new_tokens: int,
              extra: dict[str, dict] | None = None) -> list[Job]:
    """One job per (prompt, config), prompt-major, the configs' order balanced (harness.plan.interleave)."""
    cell = cell_name(link, temperature)
    return [Job(f"{cell}|{name}|{p}", cell, name, p, temperature, max_new_tokens,
                config_device(name, (extra or {}).get(name)))
            for p, name in interleave(configs, prompts)]


def prune(configs: list[str], up_bps: float, bytes_per_token: dict[str, float],
          edge_only_tps: float | None) -> tuple[list[str], dict[str, str]]:
    """(configs to run, {pruned config: why}) for a link of uplink ``up_bps`` (see PRUNE_FACTOR)."""
    if not edge_only_tps:
        return list(configs), {}
    keep, pruned = [], {}
    for name in configs:
        bpt = bytes_per_token.get(name)
        if CONFIGS[name][0] == "fixed" and name != DEFAULT_CONFIG and bpt:
            uplink_s = bpt * 8 / up_bps
            if uplink_s > PRUNE_FACTOR / edge_only_tps:
                pruned[name] = (f"uplink alone {uplink_s * 1e3:.0f} ms/token > {PRUNE_FACTOR:g} x edge-only "
                                f"{1e3 / edge_only_tps:.0f} ms/token")
                continue
        keep.append(name)
    return keep, pruned


def planned_sessions(s: Settings) -> dict:
    """Sessions and tokens the run plans (before pruning), and the changing link's seconds."""
    cells = len(links(s)) * len(s.temperatures)
    sessions = cells * len(s.configs) * s.prompts
    change_runs = len(s.temperatures) * len(s.configs) if s.changing else 0
    return {"cells": cells, "sessions": sessions, "tokens": sessions * s.max_new_tokens,
            "changing_runs": change_runs, "changing_s": change_runs * s.change_end_s}
