"""Issue 46's matrix over several bench-traces runs (bench/traces/matrix.py, bench-traces --matrix)."""
from __future__ import annotations

import gzip
import json
import math

import pytest

from specdec.bench import bench_traces
from specdec.bench.traces import analyze, matrix

C = analyze.CONTROL


def session(cell: str, config: str, prompt: int, wall: float, tokens: int = 100, **kw) -> dict:
    return {"cell": cell, "config": config, "prompt": prompt, "trace": "t", "temperature": 0.0, "rtt_ms": 40.0,
            "drafter_cost": None, "offset_s": 10.0,
            "record": {"stats": {"generated_tokens": tokens, "wall_seconds": wall, "uplink_bytes": 0,
                                 "downlink_bytes": 0}}, "extra": {}, **kw}


def run(sessions: list[dict], prompts: int = 3) -> dict:
    cells = {s["cell"]: {"name": s["cell"], "trace": "t", "rtt_ms": 40.0, "temperature": 0.0, "drafter_cost": None}
             for s in sessions}
    return {"cells": cells, "sessions": sessions, "best_fixed": "fixA", "default": "fixA", "traces_folder": "/x/heldout",
            "settings": {"prompts": prompts}, "git": {"revision": "abcdef0123"}, "started": "20261202-000000",
            "recordings": []}


def cell(name: str, auto_wall: float, control_walls: tuple[float, ...], fixed_wall: float = 12.0) -> list[dict]:
    """A cell of len(control_walls) prompts: edge-only 10 s a prompt, auto and the fixed setting at their
    walls, the control at each of ``control_walls``."""
    out = []
    for p, cw in enumerate(control_walls):
        out += [session(name, "none", p, 10.0), session(name, "auto", p, auto_wall), session(name, "fixA", p, fixed_wall),
                session(name, C, p, cw)]
    return out


def test_a_cell_below_the_line_is_a_loss_only_beyond_the_host_s_noise() -> None:
    # auto 0.95x edge-only in cell a of both runs: the quiet run's control spreads ~1 %, the noisy one's ~10 %
    quiet = run(cell("a", 10 / 0.95, (9.9, 10.1, 10.0)) + cell("b", 8.0, (10.0, 10.1, 9.9)))
    noisy = run(cell("a", 10 / 0.95, (9.0, 11.0, 11.0)))
    m = matrix.matrix([("quiet", quiet), ("noisy", noisy)])
    rows = {(r["run"], r["cell"]): r for r in m["rows"]}
    a_quiet, a_noisy, b = rows[("quiet", "a")], rows[("noisy", "a")], rows[("quiet", "b")]
    assert a_quiet["auto_vs_edge_only"] == pytest.approx(0.95) and a_quiet["noise"] == "control"
    logs = [math.log(10 / w) for w in (9.9, 10.1, 10.0, 10.0, 10.1, 9.9)]
    mean = sum(logs) / 6
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 5)
    assert a_quiet["se"] == pytest.approx(sd / math.sqrt(3))
    assert a_quiet["z"] == pytest.approx(math.log(0.95 / 0.97) / a_quiet["se"]) and a_quiet["verdict"] == "loss"
    assert a_noisy["verdict"] == "noise" and -2 < a_noisy["z"] < 0
    assert b["verdict"] == "met" and b["auto_vs_edge_only"] == pytest.approx(1.25)
    assert a_quiet["auto_vs_cell_best_fixed"] == pytest.approx(12 / (10 / 0.95))
    assert a_noisy["worst_control_session"] == pytest.approx(10 / 11)
    g = m["goals"]["auto_vs_edge_only_every_cell"]
    assert g["pass"] is False and g["cells"] == 3 and len(g["below"]) == 2
    assert g["losses"] == ["quiet: a"] and g["control_cells"] == 3 and g["control_below"] == 1  # noisy a: 30/31
    assert m["goals"]["auto_session_vs_edge_only"]["pass"]  # 0.95 over the 0.8 line
    # pooled over both runs: one group (the trace set, 40 ms, T = 0, the drafter as it runs), every session of each
    pooled = m["pooled"]["heldout 40 ms T0 natural"]
    assert pooled["auto"]["sessions"] == 9 and pooled[C]["sessions"] == 9
    autos = [math.log(0.95)] * 6 + [math.log(1.25)] * 3
    assert pooled["auto"]["geomean"] == pytest.approx(math.exp(sum(autos) / 9))
    assert m["split_prompts"] == 0
    tuning = {**noisy, "traces_folder": "/x/tuning"}
    assert sorted(matrix.matrix([("quiet", quiet), ("tuning", tuning)])["pooled"]) == [
        "heldout 40 ms T0 natural", "tuning 40 ms T0 natural"]  # the sets apart


def test_without_a_control_the_noise_is_the_a_a_pairs_or_none() -> None:
    sessions = [s for s in cell("a", 10 / 0.9, (10.0, 10.0, 10.0)) if s["config"] != C]
    row = matrix.matrix([("r", run(sessions))])["rows"][0]
    # no auto session ran edge-only rounds alone (no timeline): no A/A pair, so no noise to judge by
    assert row["noise"] == "A/A" and row["se"] is None and row["z"] is None and row["verdict"] == "noise"
    assert row["control_vs_edge_only"] is None and row["worst_control_session"] is None


def test_a_prompt_split_at_the_finish_line_is_left_out_of_the_kept_ratios() -> None:
    # prompt 1 of cell a: auto's session ends 2 s after edge-only's, and an outage began between the two
    def timed(config: str, prompt: int, wall: float) -> dict:
        t0 = 1000.0 * (prompt + 1)
        return session("a", config, prompt, wall, applied_wall=t0,
                       extra={"session_t0": t0, "session_t1": t0 + wall,
                              "timeline": [{"generated": 100, "token_t": [t0 + wall * (k + 1) / 100 for k in range(100)]}]})
    sessions = [timed("none", 0, 10.0), timed("auto", 0, 10.0), timed("fixA", 0, 10.0),
                timed("none", 1, 10.0), timed("auto", 1, 12.0), timed("fixA", 1, 10.0)]
    outages = {"t": [(10.0 + 11.0, 3.0)]}  # 11 s into the sessions, which start 10 s into the recording
    m = matrix.matrix([("r", run(sessions, prompts=2))], [outages])
    row = m["rows"][0]
    assert row["split"] == [1] and m["split_prompts"] == 1
    assert row["auto_vs_edge_only"] == pytest.approx(20 / 22)
    assert row["auto_vs_edge_only_kept"] == pytest.approx(1.0) and row["worst_session_kept"] == pytest.approx(1.0)
    assert m["goals"]["auto_vs_edge_only_every_cell"]["pass"] is False
    assert m["goals_kept"]["auto_vs_edge_only_every_cell"]["pass"] is True
    assert matrix.matrix([("r", run(sessions, prompts=2))])["rows"][0]["split"] == []


def test_the_matrix_flag_reads_each_run_dir_and_says_which_one_is_missing(tmp_path, capsys) -> None:
    d = tmp_path / "runs" / "one"
    d.mkdir(parents=True)
    with gzip.open(d / "bench_traces.json.gz", "wt") as f:
        json.dump(run(cell("a", 10 / 0.95, (9.0, 11.0, 11.0))), f)
    assert bench_traces.main(["--matrix", str(d)]) == 0
    out = capsys.readouterr().out
    assert "runs/one (abcdef0, 20261202-000000)" in out and "[MISS] auto >= 0.97x edge-only on every cell" in out
    assert "1 of 1 cells below; the control: 1 of 1 below" in out
    assert bench_traces.main(["--matrix", str(d), str(tmp_path / "nowhere")]) == 2
    assert "no bench_traces.json.gz in" in capsys.readouterr().err


def test_a_run_made_in_another_checkout_finds_its_traces_by_name_in_the_bench_s_sets() -> None:
    moved = {"name": "nyumets-subwayQ", "up": "/elsewhere/heldout/nyumets-subwayQ.up",
             "down": "/elsewhere/heldout/nyumets-subwayQ.down"}
    found = bench_traces._found(moved)
    assert found["up"].endswith("bench/traces/heldout/nyumets-subwayQ.up") and found["down"].endswith(".down")
    assert bench_traces.trace_outages([found])["nyumets-subwayQ"]  # its outages, read from the repository's copy
    gone = {"name": "x", "up": "/elsewhere/x.up", "down": "/elsewhere/x.down"}
    assert bench_traces._found(gone) == gone and bench_traces.trace_outages([gone]) == {}
