"""What every benchmark plans alike: the prompts and their seeds, the order configurations take turns
in, where a run's results go and what it records about the machine and the code. Pure but for
reading the prompt file, the clock and ``git``.

Configurations are compared within one run, on the same prompts with the same seeds, in an order
that changes from one prompt (or cell) to the next, so slow drift of the shared cores hits them alike,
and balanced for carryover (:func:`balanced`), so that what one session leaves behind does not
always slow the same configuration.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "prompts.jsonl"  # package data: chat, code, facts, stories
RESULTS = Path("results")   # below the directory the benchmark runs in (make: the repository root)
SEED_BASE = 1000            # prompt i runs with seed SEED_BASE + i in every config: the same draws everywhere
# A job's config key for the device driver: seconds to sleep after each drafter forward, emulating a
# slower device (a sleep, not a busy loop: the emulated device's slowness must not take the cores the
# edge-server shares with it here)
DRAFT_DELAY = "draft_delay_s"


def load_prompts(path: Path = PROMPTS) -> list[dict]:
    """One ``{"category", "prompt"}`` per line of the prompt file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_sample(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` prompts taken round-robin over the categories (chat, code, facts, stories)."""
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row)
    order, i = [], 0
    while len(order) < min(n, len(rows)):
        for cat in by_cat:
            if i < len(by_cat[cat]) and len(order) < n:
                order.append(by_cat[cat][i])
        i += 1
    return order


def sample_texts(n: int) -> list[str]:
    """The texts of :func:`prompt_sample` over the prompt file."""
    return [row["prompt"] for row in prompt_sample(load_prompts(), n)]


def first_per_category(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` prompts of each category, in file order."""
    taken: dict[str, int] = {}
    out = []
    for row in rows:
        if taken.get(row["category"], 0) < n:
            taken[row["category"]] = taken.get(row["category"], 0) + 1
            out.append(row)
    return out


def rotated(items: list, k: int) -> list:
    """``items`` starting at its ``k``-th (mod its length): the turn order of the ``k``-th prompt or pass."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]


def balanced(items: list, k: int) -> list:
    """The ``k``-th turn order of a Williams design (Williams 1949, "Experimental designs balanced for
    the estimation of residual effects of treatments"): over n consecutive orders (2n for an odd n) each
    item runs in each position equally often and right after each other item equally often. A
    rotation keeps each item's predecessor: in bench-traces mode auto always ran right after
    TSLT-L8, and its edge-only sessions came out ~3 % slower than edge-only's, ~1.0 with the order
    reversed."""
    n = len(items)
    if n < 3:
        return rotated(items, k)
    first, lo, hi = [0], 1, n - 1   # 0, 1, n - 1, 2, n - 2, ...: the differences cover 1 .. n - 1 once
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [items[(i + k) % n] for i in first]
    return row[::-1] if n % 2 and (k // n) % 2 else row  # an odd n needs the mirrored square too


def interleave(configs: list, prompts: int) -> list[tuple[int, object]]:
    """(prompt, config) for every prompt and config, prompt-major, the configs' order the p-th of
    :func:`balanced` for prompt p."""
    return [(p, c) for p in range(prompts) for c in balanced(list(configs), p)]


def run_dir(results: Path, name: str) -> Path:
    """``results/name`` (with logs/), and ``results/latest`` pointing at it, swapped in atomically."""
    out = results / name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tmp = results / f".latest-{name}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    os.replace(tmp, results / "latest")
    return out


def stamp(quick: bool = False) -> str:
    """A run's folder name: its start time, ``-quick`` for a quick run."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S") + ("-quick" if quick else "")


def git_info() -> dict:
    """The code a run measured: revision, branch, and tracked files modified."""
    def git(*a):
        r = subprocess.run(["git", *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no") or ""
    return {"revision": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(status), "modified": status.splitlines()}


def machine_info() -> dict:
    """The machine a run measured on, with its load average at the start: the shared cores' noise."""
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": cpu or platform.processor(), "logical_cores": os.cpu_count(),
            "affinity_cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": list(os.getloadavg())}
