"""bench-traces' slower edge (bench/harness/slow_edge.py, issue 46's 0.3x drafter point): each target
forward takes F times its own time; the edge it runs is the real edge-server, as correct as ever."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.harness import device_cli, load, run_main, target_greedy
from specdec.bench.harness import rig, slow_edge
from specdec.common.modeling import ModelSpec, encode_prompt

FORWARD_S = 0.02  # each forward of the fake-clock module below


class Clock:
    """perf_counter and sleep of a fake clock: sleeps are recorded, not slept."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


class Ticking(torch.nn.Linear):
    """A forward that takes FORWARD_S on ``clock``."""

    def __init__(self, clock: Clock):
        super().__init__(2, 2)
        self.clock = clock

    def forward(self, x):
        self.clock.now += FORWARD_S
        return super().forward(x)


def test_each_forward_sleeps_the_slowdown_less_one_times_its_own_time(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(slow_edge, "time", clock)
    slowed, plain = Ticking(clock), Ticking(clock)
    slow_edge.ForwardSlowdown(slowed, 3.0)
    slow_edge.ForwardSlowdown(plain, 1.0)
    x = torch.zeros(1, 2)
    slowed(x)
    plain(x)
    slowed(x)
    assert clock.slept == pytest.approx([2 * FORWARD_S, 2 * FORWARD_S])


def test_the_loaded_target_is_slowed_at_each_forward(tiny_pair_v512, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(slow_edge.time, "sleep", slept.append)
    target = slow_edge.slowed(2.0)(ModelSpec(model=str(tiny_pair_v512[0])))
    with torch.no_grad():
        for n in (1, 4):
            target.model(torch.zeros(1, n, dtype=torch.long))
    assert len(slept) == 2 and all(s > 0 for s in slept)


def test_a_slowdown_below_one_is_refused(capsys) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        slow_edge.ForwardSlowdown(torch.nn.Linear(2, 2), 0.5)
    for argv in (["--target-slowdown", "0.5"], ["--target-slowdown", "x"], ["--port", "0"]):
        rc, err = run_main(slow_edge.main, argv, capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("slow-edge: error:"), (argv, err)
        assert "--target-slowdown" in err


def test_the_rigs_slowed_edge_serves_the_targets_own_greedy_tokens(accepting_pair_v512) -> None:
    """The command the bench's Rig runs for --target-slowdown, as a real process on a real port."""
    target_dir, drafter_dir = accepting_pair_v512
    exe = rig.Rig(Path("."), target_slowdown=3.0).edge_exe
    assert exe[-2:] == [slow_edge.FLAG, "3"]
    edge = rig.Edge("--model", str(target_dir), exe=exe)
    try:
        r = device_cli("--edge", edge.address, "--draft-model", str(drafter_dir), "--prompt", "w5 w6 w7", "--raw",
                       "--max-new-tokens", "8", "--temperature", "0", "--json")
    finally:
        code = edge.stop()
    assert r.returncode == 0, r.stderr
    tok = load(str(drafter_dir)).tokenizer
    assert json.loads(r.stdout.splitlines()[-1])["token_ids"] == \
        target_greedy(target_dir, encode_prompt(tok, "w5 w6 w7", raw=True), 8)
    assert code == 0


def test_bench_traces_takes_a_slowdown_from_one_to_its_cap() -> None:
    from specdec.bench.bench_traces import MAX_TARGET_SLOWDOWN, parse_args, settings_from
    assert settings_from(parse_args(["--target-slowdown", "2"])).target_slowdown == 2.0
    assert settings_from(parse_args([])).target_slowdown == 1.0
    for bad in ("0.5", str(MAX_TARGET_SLOWDOWN + 1)):
        with pytest.raises(ValueError, match="--target-slowdown"):
            settings_from(parse_args(["--target-slowdown", bad]))
