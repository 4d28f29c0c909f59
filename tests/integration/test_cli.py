"""The two commands as users run them: real subprocesses, real port, JSON output, flag errors."""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.support.harness import device_cli, load, run_main, target_greedy
from specdec.device import cli as device_main
from specdec.common.modeling import encode_prompt


BAD_FLAGS = [
    (["--mode", "bogus"], "--mode"),
    (["--top-k", "0"], "--top-k"),
    (["--temperature", "-1"], "--temperature"),
    (["--draft-len", "x"], "--draft-len"),
]


@pytest.fixture(scope="module")
def runs(edge_v512, tiny_pair_v512, accepting_pair_v512, tmp_path_factory) -> dict[str, Future]:
    """Every `device-client` process of this file, started at once and run two at a time: each is
    mostly imports and model loading on one core, so two overlap on CI's two cores. Each test reads
    its own run's result. The edge is the session's edge-server process on tiny_pair_v512's target
    (conftest: it must stop with status 0)."""
    from specdec.testbed import tiny_models
    edge, drafter = edge_v512.address, str(tiny_pair_v512[1])
    other = tiny_models.make_model(tmp_path_factory.mktemp("other") / "other", 256, seed=5)
    commands = {
        "json_greedy": ["--edge", edge, "--draft-model", str(accepting_pair_v512[1]), "--prompt", "w5 w6 w7",
                        "--raw", "--mode", "ksqs", "--top-k", "32", "--lattice", "100", "--max-new-tokens", "10",
                        "--temperature", "0", "--json", "--num-samples", "2"],
        "streams_text": ["--edge", edge, "--draft-model", drafter, "--prompt", "w5 w6", "--raw", "--mode", "dssd",
                         "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3"],
        "vocabulary_mismatch": ["--edge", edge, "--draft-model", str(other), "--prompt", "w1", "--raw"],
        "unreachable_edge": ["--edge", "127.0.0.1:1", "--draft-model", drafter, "--prompt", "w1", "--raw",
                             "--timeout", "3"],
        "bad_flag": ["--edge", "127.0.0.1:1", "--prompt", "hi", *BAD_FLAGS[0][0]],
    }
    with ThreadPoolExecutor(2) as pool:
        yield {name: pool.submit(device_cli, *args, timeout=300) for name, args in commands.items()}


def test_device_client_json_greedy_matches_target(runs, accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512  # the shared edge serves this target
    r = runs["json_greedy"].result()
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


def test_device_client_streams_text(runs) -> None:
    r = runs["streams_text"].result()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("w") or r.stdout.strip() == ""


@pytest.mark.parametrize("args, needle", BAD_FLAGS)
def test_bad_flags_exit_nonzero_with_one_line(args, needle, capsys) -> None:
    """The command's own main, in this process: the message and the exit status are what is tested."""
    rc, err = run_main(device_main.main, ["--edge", "127.0.0.1:1", "--prompt", "hi", *args], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_bad_flag_ends_the_real_process_with_one_line(runs) -> None:
    """One real `device-client` process: the status reaches the shell and nothing else is printed."""
    needle = BAD_FLAGS[0][1]
    r = runs["bad_flag"].result()
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert r.stdout == ""


def test_unreachable_edge_exits_nonzero_with_one_line(runs) -> None:
    r = runs["unreachable_edge"].result()
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], r.stderr


def test_vocabulary_mismatch_is_refused_with_a_reason(runs) -> None:
    r = runs["vocabulary_mismatch"].result()
    assert r.returncode != 0
    assert "FAILED_PRECONDITION" in r.stderr and "vocabulary mismatch" in r.stderr


def test_edge_server_bad_flag_exits_nonzero(tmp_path, capsys) -> None:
    import subprocess
    from tests.support.harness import VENV_BIN
    from specdec.edge import __main__ as edge_main
    r = subprocess.run([str(VENV_BIN / "edge-server"), "--max-sessions", "0"], capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    # A model that cannot load: the command's own main in this process (the real process above shows
    # the status reaching the shell); its error is its last stderr line.
    rc, err = run_main(edge_main.main, ["--model", str(tmp_path / "missing"), "--port", "0"], capsys)
    assert rc != 0 and err.strip().splitlines()[-1].startswith("edge-server: error"), err
