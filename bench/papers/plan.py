"""What one benchmark run measures: settings (quick / full), the prompt sample, and the jobs per link.

A *config* is one way of running the pair (mode, its parameters, chain or tree). A *point* is one
config on one link. Every point of the rate curve runs the same prompts with the same seeds, so the
sessions at different rates draw the same tokens (CPU forwards are deterministic at one thread):
across rates only the timing differs. The loopback link runs more prompts (the first ones are the
rate-curve sample) for the acceptance and byte figures, and the extra TSLT K values of Fig. 4.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from specdec.bench.harness.plan import SEED_BASE

LOOPBACK = 0.0            # rate_bps of the unshaped loopback link
# K grid of the top-K mass curve (TSLT Fig. 3): powers of two plus the paper's 32 / 320 / 3200.
# The last entry stands for K = |V| (the driver clamps K to the vocabulary).
FULL_VOCAB_K = 2 ** 31 - 1
TOPK_GRID = sorted({2 ** i for i in range(16)} | {32, 320, 3200}) + [FULL_VOCAB_K]
MIN_REDUCED_TOKENS = 8    # a slow point never runs shorter sessions than this


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    temperature: float = 1.0            # sampling, as in the papers' figures (greedy makes top-K mass 1)
    draft_len: int = 4                  # chain length L (device-client's default)
    tree: tuple[int, ...] = (2, 2, 2)   # TSLT Sec. 5 expansion configuration
    max_new_tokens: int = 32            # per session
    rate_prompts: int = 1               # prompts per rate-curve point (the same at every link)
    loop_prompts: int = 3               # prompts per loopback point (>= rate_prompts) and per ceiling
    rates_mbit: tuple[float, ...] = (100.0, 50.0, 10.0, 5.0, 1.0)  # shaped uplinks, fast to slow
    down_rate_mbit: float = 0.0         # 0 = downlink unshaped (the TSLT model ignores the downlink)
    tslt_ks: tuple[int, ...] = (32, 320, 3200)      # TSLT K of the rate curve (Fig. 5-6)
    ksweep_extra: tuple[int, ...] = (8, 100, 1000)  # more K at loopback only (Fig. 4)
    ksqs_k: int = 64                    # K-SQS support (device-client default)
    lattice: int = 1000                 # K-SQS / C-SQS lattice resolution (device-client default)
    csqs_alpha: float = 0.01            # C-SQS target dropped mass (device-client default)
    sqs_temps: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)   # SQS Fig. 2 sweep
    sqs_prompts: int = 1
    sqs_bit_budget: int = 5000          # SQS Sec. 4: B = 5000 bits per round
    sqs_lattice: int = 100              # SQS Sec. 4: ell = 100
    sqs_alpha: float = 0.0005           # SQS Sec. 4: alpha = 0.0005, eta = 0.001
    sqs_eta: float = 0.001
    sqs_max_draft: int = 8              # cap on the budget-set draft length (the paper has none)
    point_budget_s: float = 45.0        # no new session of a point starts after this long; slow links
                                        # cut a point's tokens so one session fits about this long
    loop_budget_s: float = 120.0        # the same for loopback jobs
    tree_modes: tuple[str, ...] = ()      # config names also run as trees; () = all but DSSD
    shaped_configs: tuple[str, ...] = ()  # config keys run on shaped links; () = all grid configs

    @classmethod
    def preset(cls, quick: bool) -> "Settings":
        if not quick:
            return cls()
        return cls(quick=True, max_new_tokens=12, rate_prompts=1, loop_prompts=1, rates_mbit=(5.0,),
                   ksweep_extra=(), sqs_temps=(0.0, 1.0), point_budget_s=15.0, loop_budget_s=20.0,
                   tree_modes=("dense", "tslt-320"),
                   shaped_configs=("dense/chain", "tslt-320/chain", "dssd/chain"))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Config:
    name: str                 # e.g. "tslt-320", "dense", "dssd"
    shape: str                # "chain" or "tree"
    device: dict              # DeviceConfig overrides
    family: str               # mode family for colours / grouping: dense, tslt, ksqs, csqs, dssd
    k: int | None = None      # TSLT K (None: not a TSLT config)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.shape}"


@dataclass(frozen=True)
class Link:
    name: str                 # "loopback" or e.g. "10mbit"
    rate_bps: float           # uplink; LOOPBACK (0) = unshaped loopback
    down_rate_bps: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.rate_bps > 0


@dataclass
class Job:
    id: str
    link: str
    config: Config
    prompts: list[int]        # indices into the prompt sample
    max_new_tokens: int
    budget_s: float
    topk_grid: list[int] | None = None
    role: str = "grid"        # grid (a rate-curve point) | grid-extra (more loopback prompts) | ksweep | sqs
    reduced: bool = False     # sample cut down for a slow link (see reduce_for_link)
    extra: dict = field(default_factory=dict)

    def to_driver(self, prompts: list[str]) -> dict:
        return {"id": self.id, "config": {**self.config.device, "max_new_tokens": self.max_new_tokens},
                "prompts": [prompts[i] for i in self.prompts], "seeds": [SEED_BASE + i for i in self.prompts],
                "topk_grid": self.topk_grid, "budget_s": self.budget_s, "extras": ["distributions"]}


def base_device(s: Settings) -> dict:
    return {"temperature": s.temperature, "draft_len": s.draft_len}


def grid_configs(s: Settings) -> list[Config]:
    """The modes of the rate curve (TSLT Fig. 5-6), chain and tree. DSSD has no tree form."""
    base = base_device(s)
    modes = [Config("dense", "chain", {**base, "mode": "dense", "dense_dtype": "fp16"}, "dense")]
    modes += [Config(f"tslt-{k}", "chain", {**base, "mode": "tslt", "top_k": k}, "tslt", k) for k in s.tslt_ks]
    modes += [Config("ksqs", "chain", {**base, "mode": "ksqs", "top_k": s.ksqs_k, "lattice": s.lattice}, "ksqs"),
              Config("csqs", "chain", {**base, "mode": "csqs", "lattice": s.lattice, "csqs_alpha": s.csqs_alpha},
                     "csqs"),
              Config("dssd", "chain", {**base, "mode": "dssd"}, "dssd")]
    trees = [replace(c, shape="tree", device={**c.device, "tree": list(s.tree)}) for c in modes
             if c.family != "dssd" and (not s.tree_modes or c.name in s.tree_modes)]
    return modes + trees


def ksweep_configs(s: Settings) -> list[Config]:
    base = base_device(s)
    out = []
    for k in s.ksweep_extra:
        chain = Config(f"tslt-{k}", "chain", {**base, "mode": "tslt", "top_k": k}, "tslt", k)
        out += [chain, replace(chain, shape="tree", device={**chain.device, "tree": list(s.tree)})]
    return out


def sqs_configs(s: Settings) -> list[Config]:
    """SQS Fig. 2: K-SQS and C-SQS with the paper's B and ell across temperatures."""
    out = []
    for t in s.sqs_temps:
        common = {"temperature": t, "draft_len": s.sqs_max_draft, "bit_budget": s.sqs_bit_budget,
                  "lattice": s.sqs_lattice}
        out.append(Config(f"ksqs@T{t:g}", "chain", {**common, "mode": "ksqs", "top_k": s.ksqs_k}, "ksqs"))
        out.append(Config(f"csqs@T{t:g}", "chain", {**common, "mode": "csqs", "csqs_alpha": s.sqs_alpha,
                                                     "csqs_eta": s.sqs_eta}, "csqs"))
    return out


def links(s: Settings) -> list[Link]:
    down = s.down_rate_mbit * 1e6
    return [Link("loopback", LOOPBACK)] + [Link(f"{r:g}mbit", r * 1e6, down) for r in s.rates_mbit]


def sqs_link(s: Settings, shaped_ok: bool) -> str:
    """SQS Fig. 2 runs on the slowest shaped uplink (the constrained case), else on loopback."""
    return f"{min(s.rates_mbit):g}mbit" if (s.rates_mbit and shaped_ok) else "loopback"


def loopback_jobs(s: Settings) -> tuple[list[Job], list[Job]]:
    """(rate-curve jobs, the rest): the rate-curve prompts of every grid config (each followed by its
    target-alone baseline), then the other loopback prompts and the extra TSLT K values."""
    rate, rest = [], []
    grid = grid_configs(s)
    for c in grid:
        topk = TOPK_GRID if c.family == "dense" else None
        rate.append(Job(f"loopback|{c.key}", "loopback", c, list(range(s.rate_prompts)), s.max_new_tokens,
                        s.loop_budget_s, topk, "grid"))
        if s.loop_prompts > s.rate_prompts:
            rest.append(Job(f"loopback+|{c.key}", "loopback", c, list(range(s.rate_prompts, s.loop_prompts)),
                            s.max_new_tokens, s.loop_budget_s, topk, "grid-extra"))
    for c in ksweep_configs(s):
        rest.append(Job(f"loopback|{c.key}", "loopback", c, list(range(s.loop_prompts)), s.max_new_tokens,
                        s.loop_budget_s, None, "ksweep"))
    return rate, rest


def shaped_jobs(s: Settings, link: Link, loop_cost: dict[str, dict] | None = None) -> list[Job]:
    """Rate-curve jobs for one shaped link; slow points shrink their sample to fit the point budget.

    ``loop_cost[config key]`` = {"session_s", "rounds", "up_bits"}: per-session loopback means. The
    link adds up_bits / rate per round; a point whose one session would take far longer than its
    budget runs one prompt with fewer new tokens (marked ``reduced``).
    """
    jobs = []
    for c in shaped_grid(s):
        prompts, tokens, reduced = list(range(s.rate_prompts)), s.max_new_tokens, False
        cost = (loop_cost or {}).get(c.key)
        if cost:
            per_session = cost["session_s"] + cost["rounds"] * cost["up_bits"] / link.rate_bps
            if per_session * len(prompts) > s.point_budget_s:
                keep = max(1, int(s.point_budget_s // per_session))
                reduced = keep < len(prompts)
                prompts = prompts[:keep]
            if per_session > 1.5 * s.point_budget_s:
                tokens = max(MIN_REDUCED_TOKENS, int(tokens * s.point_budget_s / per_session))
                reduced = reduced or tokens < s.max_new_tokens
        jobs.append(Job(f"{link.name}|{c.key}", link.name, c, prompts, tokens, s.point_budget_s, None, "grid",
                        reduced))
    return jobs


def shaped_grid(s: Settings) -> list[Config]:
    return [c for c in grid_configs(s) if not s.shaped_configs or c.key in s.shaped_configs]


def sqs_jobs(s: Settings, link_name: str) -> list[Job]:
    prompts = list(range(s.sqs_prompts))
    return [Job(f"{link_name}|{c.key}", link_name, c, prompts, s.max_new_tokens, s.point_budget_s, None, "sqs")
            for c in sqs_configs(s)]


def planned_sessions(s: Settings, shaped_ok: bool) -> int:
    """Device sessions plus target-alone baselines (one per rate-curve point, rate_prompts sessions)."""
    rate, rest = loopback_jobs(s)
    points = len(rate) + (len(s.rates_mbit) * len(shaped_grid(s)) if shaped_ok else 0)
    n = sum(len(j.prompts) for j in rest) + len(sqs_configs(s)) * s.sqs_prompts
    return n + 2 * points * s.rate_prompts
