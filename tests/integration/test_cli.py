"""The two commands as users run them: real subprocesses, real port, JSON output, flag errors."""
from __future__ import annotations

import json

import pytest

from tests.support.harness import EdgeProcess, device_cli, load, target_greedy
from specdec.common.modeling import encode_prompt


@pytest.fixture(scope="module")
def edge_proc(tiny_pair_v512):
    proc = EdgeProcess("--model", str(tiny_pair_v512[0]))
    yield proc
    assert proc.stop() == 0  # SIGTERM: graceful shutdown, exit status 0


def test_device_client_json_greedy_matches_target(edge_proc, accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512  # edge_proc serves this target
    r = device_cli("--edge", edge_proc.address, "--draft-model", str(drafter_dir), "--prompt", "w5 w6 w7",
                   "--raw", "--mode", "ksqs", "--top-k", "32", "--lattice", "100", "--max-new-tokens", "10",
                   "--temperature", "0", "--json", "--num-samples", "2")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 2
    tok = load(str(drafter_dir)).tokenizer
    expected = target_greedy(target_dir, encode_prompt(tok, "w5 w6 w7", raw=True), 10)
    for rec in lines:
        assert rec["token_ids"] == expected
        stats = rec["stats"]
        for key in ("rounds", "draft_tokens", "accepted_tokens", "uplink_bytes", "downlink_bytes", "wall_seconds"):
            assert stats[key] > 0, key
        assert set(stats["time"]) == {"draft", "encode", "network", "verify"}
        assert rec["text"] == tok.decode(expected, skip_special_tokens=True)


def test_device_client_streams_text(edge_proc, tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    r = device_cli("--edge", edge_proc.address, "--draft-model", str(drafter_dir), "--prompt", "w5 w6",
                   "--raw", "--mode", "dssd", "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("w") or r.stdout.strip() == ""


@pytest.mark.parametrize("args, needle", [
    (["--mode", "bogus"], "--mode"),
    (["--top-k", "0"], "--top-k"),
    (["--temperature", "-1"], "--temperature"),
    (["--draft-len", "x"], "--draft-len"),
])
def test_bad_flags_exit_nonzero_with_one_line(args, needle) -> None:
    r = device_cli("--edge", "127.0.0.1:1", "--prompt", "hi", *args, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_unreachable_edge_exits_nonzero_with_one_line(tiny_pair_v512) -> None:
    r = device_cli("--edge", "127.0.0.1:1", "--draft-model", str(tiny_pair_v512[1]), "--prompt", "w1",
                   "--raw", "--timeout", "3", timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], r.stderr


def test_vocabulary_mismatch_is_refused_with_a_reason(edge_proc, tmp_path) -> None:
    from specdec.testbed import tiny_models
    other = tiny_models.make_model(tmp_path / "other", 256, seed=5)
    r = device_cli("--edge", edge_proc.address, "--draft-model", str(other), "--prompt", "w1", "--raw")
    assert r.returncode != 0
    assert "FAILED_PRECONDITION" in r.stderr and "vocabulary mismatch" in r.stderr


def test_edge_server_bad_flag_exits_nonzero(tmp_path) -> None:
    import subprocess
    from tests.support.harness import VENV_BIN
    r = subprocess.run([str(VENV_BIN / "edge-server"), "--max-sessions", "0"], capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([str(VENV_BIN / "edge-server"), "--model", str(tmp_path / "missing"), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("edge-server: error")
