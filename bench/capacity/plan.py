"""What bench-capacity runs: the settings, the serving modes (one table), the interleaved schedule.
Pure: no I/O."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from specdec.bench.harness.plan import rotated

# Serving modes: which edge process serves the N clients and what the clients send. The edge's extra
# flags per edge kind are here and nowhere else; ``requires``: the edge-server flag that kind needs
# (checked against ``edge-server --help``; a kind whose flag is missing is skipped and reported).
EDGES = {
    "batched": {"args": [], "requires": "--no-batching"},      # default edge, when batching exists
    "unbatched": {"args": ["--no-batching"], "requires": "--no-batching"},
    "plain": {"args": [], "requires": None},                   # an edge without batching flags: today's
}
SERVING = {
    # name: (edge kind, client kind); edge-only clients use mode none on the batched edge (batched decoding)
    "batched": ("batched", "replay"),
    "unbatched": ("unbatched", "replay"),
    "edge-only": ("batched", "edge-only"),
    # not in the default run: edge-only on the unbatched edge (today's one-session-per-forward decoding)
    "edge-only-unbatched": ("unbatched", "edge-only"),
}
# Without --no-batching the default edge is the unbatched one: serve both with the plain edge.
FALLBACK_EDGE = {"batched": None, "unbatched": "plain"}
MODES = ("batched", "unbatched", "edge-only")   # the default run's; the goals compare these three

FULL_NS = (1, 2, 4, 8, 16, 32)
QUICK_NS = (1, 2, 8)
VALIDATION_NS = (1, 2)   # replay vs real device-clients


@dataclass(frozen=True)
class Settings:
    ns: tuple[int, ...] = FULL_NS
    max_new_tokens: int = 128          # per session
    prompts: int = 8                   # distinct prompts; client i starts at prompt i mod prompts
    sessions_per_client: int = 1       # back to back per client within a cell
    temperatures: tuple[float, ...] = (0.0,)
    repeats: int = 2                   # passes over the whole (N x mode) grid, interleaved
    modes: tuple[str, ...] = MODES
    validate: bool = True              # real device-clients at VALIDATION_NS, same edge, same prompts
    validation_tokens: int = 96
    edge_threads: int = 1              # torch threads of each edge-server (--threads)
    # CPUs every edge-server is pinned to (taskset): by default the last core, so that each kind of
    # edge computes on one core whatever its threading. Unpinned, the --no-batching edge runs its
    # worker threads' forwards on both cores at once while the batched one runs one forward at a
    # time, and the comparison measures the core count, not batching. () = no pinning.
    edge_cpus: tuple[int, ...] = field(default_factory=lambda: default_edge_cpus())
    quick: bool = False

    @classmethod
    def preset(cls, quick: bool) -> "Settings":
        if quick:
            return cls(ns=QUICK_NS, max_new_tokens=48, prompts=4, repeats=1, validation_tokens=48, quick=True)
        return cls()

    def to_json(self) -> dict:
        return asdict(self)


def default_edge_cpus() -> tuple[int, ...]:
    """The last CPU this process may use, if it has at least two (the load generator keeps the rest)."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[-1],) if len(cpus) >= 2 else ()


def check(s: Settings) -> None:
    """ValueError with one line for settings no run can honour."""
    if not s.ns or any(n < 1 for n in s.ns):
        raise ValueError(f"device counts must be >= 1, got {list(s.ns)}")
    if s.max_new_tokens < 2:
        raise ValueError(f"--tokens must be >= 2, got {s.max_new_tokens}")
    if s.prompts < 1 or s.sessions_per_client < 1 or s.repeats < 1 or s.edge_threads < 1:
        raise ValueError("--prompts, --sessions, --repeats and --edge-threads must be >= 1")
    if not set(s.edge_cpus) <= os.sched_getaffinity(0):
        raise ValueError(f"--edge-cpus {list(s.edge_cpus)} not all usable here (cpus {sorted(os.sched_getaffinity(0))})")
    if any(t < 0 for t in s.temperatures) or not s.temperatures:
        raise ValueError(f"temperatures must be >= 0, got {list(s.temperatures)}")
    unknown = set(s.modes) - set(SERVING)
    if unknown:
        raise ValueError(f"unknown serving modes {sorted(unknown)}; known: {', '.join(SERVING)}")


def edge_kinds(available_flags: set[str], modes: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """({serving mode: edge kind} for the modes this edge-server can serve, {skipped mode: why})."""
    chosen, skipped = {}, {}
    for mode in modes:
        kind = SERVING[mode][0]
        need = EDGES[kind]["requires"]
        if need is None or need in available_flags:
            chosen[mode] = kind
        elif FALLBACK_EDGE.get(kind):
            chosen[mode] = FALLBACK_EDGE[kind]
        else:
            skipped[mode] = f"edge-server has no {need} (no batching scheduler yet)"
    return chosen, skipped


@dataclass(frozen=True)
class Cell:
    repeat: int
    temperature: float
    n: int
    mode: str

    @property
    def name(self) -> str:
        return f"T{self.temperature:g}|N{self.n}|{self.mode}|r{self.repeat}"


def schedule(s: Settings, modes: list[str]) -> list[Cell]:
    """Every (temperature, N, mode) cell ``repeats`` times; within one N the modes follow each other
    (rotated by repeat and N) so that slow drift of the shared machine hits them alike."""
    cells = []
    for r in range(s.repeats):
        for temp in s.temperatures:
            for j, n in enumerate(s.ns):
                for mode in rotated(list(modes), r + j):
                    cells.append(Cell(r, temp, n, mode))
    return cells


def client_prompts(n: int, s: Settings) -> list[list[int]]:
    """Prompt indices of each of ``n`` clients' sessions: client i starts at i mod prompts."""
    return [[(i + k) % s.prompts for k in range(s.sessions_per_client)] for i in range(n)]


def client_seeds(n: int, s: Settings) -> list[list[int]]:
    """Session seeds (T > 0): every session of a cell its own, the same in every mode and repeat."""
    return [[i * s.sessions_per_client + k for k in range(s.sessions_per_client)] for i in range(n)]


def recordings_needed(s: Settings) -> list[tuple[float, int, int]]:
    """(temperature, prompt index, seed) of every recording a run replays (T = 0: one per prompt)."""
    out = set()
    n = max(max(s.ns), max(VALIDATION_NS) if s.validate and 0.0 in s.temperatures else 0)
    for temp in s.temperatures:
        for prompts, seeds in zip(client_prompts(n, s), client_seeds(n, s)):
            for p, seed in zip(prompts, seeds):
                out.add((temp, p, 0 if temp == 0 else seed))
    return sorted(out)


def with_overrides(s: Settings, **kw) -> Settings:
    return replace(s, **{k: v for k, v in kw.items() if v is not None})
