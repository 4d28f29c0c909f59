"""`make gpu-check`'s CPU smoke run (tiny models, real edge-server processes) in the default suite, so
the check a lent GPU machine runs cannot rot between the sessions that have one; and the runtime check
that decides whether that machine needs the carried grpcio / protobuf wheels."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_smoke_run_measures_every_stage(tmp_path) -> None:
    """With an A/B's variant arm: the CPU's batched edge verifying each forward's rounds while the next
    one runs (CUDA's default), its cells beside the default's."""
    out = tmp_path / "out"
    proc = subprocess.run(["sh", str(ROOT / "bench" / "gpu_check_device.sh"), "--cpu-smoke", "--out", str(out),
                           "--variant-args=--verify-overlap on"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["tests"] == {"skipped": "CPU smoke run"}  # the suite itself imports tests/gpu
    assert data["bandwidth"]["bytes_per_s"] > 0
    [m] = data["models"]
    assert "error" not in m, m.get("error")
    for layout in ("slots", "per-session"):
        for curve in m["cost"][layout].values():
            values = [s for by_b in curve["BxL"].values() for s in by_b.values()] + list(curve["T"].values())
            assert values and all(s > 0 for s in values), (layout, curve)
        assert m["phases"][layout]["forward"] > 0 and m["phases"][layout]["verify_device_T0"] > 0
    assert m["phases"]["per-session"]["copy"] > 0  # the padded path copies caches; slots do not
    capacity = m["capacity"]
    assert "error" not in capacity, capacity.get("error")
    assert capacity["identity"]["edge_only_equals_target_alone"] is True
    settings = capacity["settings"]
    cells = capacity["cells"]
    assert settings["variant_args"] == ["--verify-overlap", "on"]
    assert len(cells) == len(settings["ns"]) * (3 * len(settings["alphas"]) + 2)
    assert sum(c.get("edge") == "variant" for c in cells) == len(settings["ns"]) * (len(settings["alphas"]) + 1)
    for c in cells:
        assert c["stats"]["aggregate_tps"] > 0 and c["divergences"] == 0 and not c["errors"], c
        if c["mode"] != "unbatched":
            assert c["batch"]["available"] and c["batch"]["mean_sessions"] >= 1, c
        if c["mode"] != "edge-only":
            assert 0.5 < c["acceptance"] <= 1.0, c  # proposals built at 0.8 per position
    assert set(m["goals"]) >= {"one_5_token_forward_over_floor", "32x5_over_1x5", "capacity_batched_over_unbatched"}
    ab = capacity["over_variant"]
    assert set(ab) == {str(n) for n in settings["ns"]}
    assert all(set(r) == {"batched a=0.8", "edge-only"} and all(v > 0 for v in r.values()) for r in ab.values()), ab
    assert "A/B at N = 1, tok/s over the variant's (--verify-overlap on): batched a=0.8 " in proc.stdout
    png = (out / "gpu_check.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def _runtime_check():
    spec = importlib.util.spec_from_file_location("gpu_runtime_check", ROOT / "bench" / "gpucheck" / "runtime_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runtime_check_says_which_runtime_is_too_old(tmp_path, monkeypatch) -> None:
    check = _runtime_check()
    assert check.problems() == []  # this environment runs the generated code
    for need, old in (("99.0.0", True), ("0.0.1", False)):
        pb = tmp_path / need
        pb.mkdir()
        major, minor, patch = need.split(".")
        (pb / "speculative_pb2_grpc.py").write_text(f"GRPC_GENERATED_VERSION = '{need}'\n")
        (pb / "speculative_pb2.py").write_text(
            f"_runtime_version.ValidateProtobufRuntimeVersion(\n    _runtime_version.Domain.PUBLIC,\n    {major},\n"
            f"    {minor},\n    {patch},\n)\n")
        monkeypatch.setattr(check, "PB", pb)
        found = check.problems()
        assert (len(found) == 2) == old, found
        if old:
            assert "grpcio" in found[0] and "older than the generated code needs (99.0.0)" in found[0]
    monkeypatch.setattr(check, "PB", tmp_path / "missing")
    assert "make proto" in check.problems()[0]


def test_the_goals_read_the_graph_probe_where_its_logits_matched() -> None:
    """On the committed H200 run: the eager curve's 1 x 5 is ~6x the floor, the graph probe's ~2.2x;
    a probe whose logits differed from the eager forward's does not count."""
    from specdec.bench.gpu_check import model_goals

    m = json.loads((ROOT / "docs" / "bench" / "gpu" / "warm" / "gpu_check.json").read_text())["models"][0]
    goals = model_goals(m, m["floor_s"])
    eager, graph = goals["one_5_token_forward_over_floor"]["value"], goals["one_5_token_graph_over_floor"]["value"]
    assert graph == pytest.approx(m["graphs"][0]["graph_s"] / m["floor_s"]) and graph < eager / 2
    assert goals["32x5_over_1x5_graphs"]["value"] == pytest.approx(m["graphs"][1]["graph_s"] / m["graphs"][0]["graph_s"])
    m["graphs"] = [{**g, "same_logits": False} for g in m["graphs"]]
    assert model_goals(m, m["floor_s"])["one_5_token_graph_over_floor"]["value"] is None


def test_edge_args_reach_the_capacity_edges_and_a_bad_flag_is_one_line() -> None:
    from specdec.bench.gpu_check import parse_args, plan_from

    p, a = parse_args(["--cpu-smoke", "--edge-args=--cuda-graphs off --batch-wait-ms 1"])
    assert plan_from(p, a).capacity.edge_args == ("--kv-cache", "slots", "--cuda-graphs", "off", "--batch-wait-ms", "1")
    assert plan_from(p, a).capacity.variant_args is None
    p, a = parse_args(["--cpu-smoke", "--variant-args=--verify-overlap off"])
    assert plan_from(p, a).capacity.variant_args == ("--verify-overlap", "off")
    proc = subprocess.run([sys.executable, "-m", "specdec.bench.gpu_check", "--ns", "x"], capture_output=True, text=True)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
