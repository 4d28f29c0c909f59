"""What bench-traces runs: the traces, the cells, the configurations, where each session starts in
its trace, and the emulator's control line for it. Pure but for listing the traces folder.

A *cell* is one recorded link (a Mahimahi ``NAME.up`` / ``NAME.down`` pair: uplink and downlink
capacity) at one base round trip (one-way delay RTT / 2 each way, on top of the trace) and one
temperature. In a cell every configuration runs the same prompts with the same seeds, prompt i
starting at the same offset into the trace for every configuration (the emulator restarts the
trace there right before the session), the configurations' order balanced from one prompt to the next
(harness.plan.balanced, its rows continuing across cells).
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.bench.harness.plan import DRAFT_DELAY, SEED_BASE, balanced
from specdec.bench.links import plan as links_plan
from specdec.testbed.traces import load_trace, trace_pairs

# The traces shipped beside the repository (the project's shared folder), looked for from where the
# benchmark runs (make: the repository root) and from the source tree.
DEFAULT_TRACES = (Path("../shared/traces"), Path(__file__).resolve().parents[2] / "../shared/traces")
# The repository's own trace sets (issue 46): held out from every constant, and the tuning set beside them.
TRACE_SETS = (Path(__file__).resolve().parent / "heldout", Path(__file__).resolve().parent / "tuning")
LINKS_RESULTS = Path(__file__).resolve().parents[2] / "docs/bench/links/bench_links.json.gz"
# The fixed configuration that was best in most grid cells of the committed links run (r6: TSLT K = 256
# L = 8 in 21 of 32), used when that run is not at hand.
FALLBACK_BEST_FIXED = "tslt256-L8"
DEFAULT = links_plan.DEFAULT_CONFIG   # the fixed default: TSLT K = 256, L = 4
# A session starts no later than this before the end of the shorter of its two traces, so that no
# session wraps around a trace's end (which would splice two unrelated moments of the recording).
SESSION_ROOM_S = 30.0


def cost_label(cost: float | str | None) -> str:
    """A drafter cost as --drafter-costs spells it (None, or "null" once a run's JSON is read back:
    the drafter as it runs)."""
    return "natural" if cost in (None, "null") else f"{float(cost):g}x"


def best_fixed_of_links_grid(path: Path = LINKS_RESULTS) -> tuple[str, str]:
    """(config, why): the fixed configuration best in most grid cells of the committed links run."""
    try:
        data = json.loads(gzip.open(path).read())
        counts = Counter(c["summary"]["best_fixed"] for c in data["cells"].values()
                         if c["link"]["kind"] == "grid" and c["summary"].get("best_fixed"))
        name, n = counts.most_common(1)[0]
        return name, f"best fixed in {n} of {sum(counts.values())} grid cells of {path.name} ({data.get('started')})"
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return FALLBACK_BEST_FIXED, f"committed links run not readable ({type(exc).__name__}); r6's best"


def find_traces(folder: Path | None) -> Path | None:
    """``folder``, or the first default folder that holds a trace pair."""
    for f in ([folder] if folder is not None else DEFAULT_TRACES):
        if f.is_dir() and trace_pairs(f):
            return f.resolve()
    return None


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    rtts_ms: tuple[float, ...] = (40.0, 80.0)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompts: int = 3                # per cell: prompt i starts at offset i of the trace
    max_new_tokens: int = 96
    queue: tuple[float, float] = (0.0, 0.0)   # drop-tail limit (bytes, packets) of each direction; 0 = none
    only: tuple[str, ...] = ()      # trace names (substrings) to run; () = all
    check_seconds: float = 20.0     # per trace: the emulator against the trace (0: skip)
    # drafter cost per forward as a multiple of the target's per token, reached by a delay after each
    # drafter forward (a slower device); () = the drafter as it runs here (its cost measured and reported)
    drafter_costs: tuple[float | None, ...] = ()
    # the edge's target forwards slowed to this multiple of their own time (harness.slow_edge): drafter
    # costs below what this machine gives (a device fast against its edge); 1 = as it runs
    target_slowdown: float = 1.0
    # every session goes on past end-of-sequence tokens to max_new_tokens (Hello.ignore_eos): at T > 0 a
    # race text (auto, edge-only) and a sampled one (a fixed chain mode) end at different lengths, and a
    # shorter session weighs its first token's wait more
    ignore_eos: bool = False
    # edge-only run a second time in each cell (analyze.CONTROL): the host's noise measured in the run
    control: bool = False

    @classmethod
    def preset(cls, quick: bool) -> "Settings":
        if not quick:
            return cls()
        return cls(quick=True, rtts_ms=(80.0,), prompts=2, max_new_tokens=48, check_seconds=0.0)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Recording:
    """One trace pair."""
    name: str
    up: str
    down: str
    period_s: float                 # the shorter of the two traces
    offsets_s: tuple[float, ...]    # where prompt i's sessions start

    def emulator(self, offset_s: float, rtt_ms: float, queue: tuple[float, float]) -> dict:
        """The control line that starts this recording at ``offset_s`` under a base round trip."""
        common = {"delay_s": rtt_ms / 2e3, "trace_offset_s": offset_s, "queue_bytes": queue[0],
                  "queue_packets": queue[1]}
        return {"uplink": {"trace": self.up, **common}, "downlink": {"trace": self.down, **common}}


def offsets(period_s: float, n: int) -> tuple[float, ...]:
    """``n`` session starts spread evenly over the trace (each window's middle), whole tenths of a second."""
    usable = max(0.0, period_s - SESSION_ROOM_S)
    return tuple(round((i + 0.5) * usable / n, 1) for i in range(n))


def recordings(folder: Path, s: Settings) -> list[Recording]:
    out = []
    for name, (up, down) in trace_pairs(folder).items():
        if s.only and not any(pat in name for pat in s.only):
            continue
        period = min(load_trace(up).period_ms, load_trace(down).period_ms) / 1e3
        out.append(Recording(name, str(up), str(down), period, offsets(period, s.prompts)))
    return out


@dataclass
class Session:
    """One planned session: a configuration on one prompt at one offset of one cell."""
    cell: str
    trace: str
    rtt_ms: float
    temperature: float
    config: str
    prompt: int
    offset_s: float
    device: dict = field(default_factory=dict)
    drafter_cost: float | None = None   # the drafter slowed to this multiple of the target's token (None: as is)

    @property
    def id(self) -> str:
        return f"{self.cell}|{self.config}|{self.prompt}"

    def to_driver(self, prompts: list[str], max_new_tokens: int, ignore_eos: bool = False) -> dict:
        return {"id": self.id, "config": {**self.device, "temperature": self.temperature,
                                          "max_new_tokens": max_new_tokens, **({"ignore_eos": True} if ignore_eos else {})},
                "prompts": [prompts[self.prompt % len(prompts)]], "seeds": [SEED_BASE + self.prompt],
                "extras": ["timeline"]}


def cell_name(trace: str, rtt_ms: float, temperature: float, drafter_cost: float | None = None) -> str:
    slow = f"/draft{drafter_cost:g}x" if drafter_cost is not None else ""
    return f"{trace}-{rtt_ms:g}ms@T{temperature:g}{slow}"


def cell_sessions(rec: Recording, rtt_ms: float, temperature: float, configs: list[str],
                  extra: dict[str, dict], drafter_cost: float | None = None, delay_s: float = 0.0,
                  first_row: int = 0) -> list[Session]:
    """Prompt-major, prompt p's configurations in the ``first_row + p``-th order of a design balanced
    for carryover (the caller continues the rows from cell to cell); ``delay_s`` after each drafter
    forward (the driver's DRAFT_DELAY) where the drafter is slowed to ``drafter_cost``."""
    cell = cell_name(rec.name, rtt_ms, temperature, drafter_cost)
    slow = {DRAFT_DELAY: delay_s} if delay_s > 0 else {}
    return [Session(cell, rec.name, rtt_ms, temperature, name, p, rec.offsets_s[p],
                    {**links_plan.config_device(name, extra.get(name)), **slow}, drafter_cost)
            for p in range(len(rec.offsets_s)) for name in balanced(list(configs), first_row + p)]


def drafter_delays(costs: tuple[float | None, ...], target_token_s: float,
                   drafter_forward_s: float) -> dict[float | None, float]:
    """Seconds to add after each drafter forward so that it costs ``cost`` times the target's token: 0
    for None (the drafter as it runs) and where the drafter is already that slow (the cell's
    calibration says so)."""
    return {c: 0.0 if c is None else max(0.0, c * target_token_s - drafter_forward_s) for c in costs}


def role(config: str) -> str:
    return links_plan.CONFIGS[config][0]
