"""Both commands with no thread flag: on a shared host each takes its share of the cores and says so
in one line; --threads and OMP_NUM_THREADS silence the rule."""
from __future__ import annotations

import os
import subprocess

import torch

from tests.support.harness import VENV_BIN
from specdec.common.runtime import choose_threads, usable_cores
from specdec.device import cli as device_main

THREAD_LINE = "torch thread(s):"


def _env_without_omp() -> dict:
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _device(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "device-client"), "--edge", "127.0.0.1:1", "--prompt", "w1", "--raw",
                           "--timeout", "2", "--reconnect-timeout", "0", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def test_device_client_logs_its_share_of_a_shared_host(tiny_pair_v512, monkeypatch, capsys) -> None:
    drafter = str(tiny_pair_v512[1])
    r = _device("--draft-model", drafter, env=_env_without_omp())
    assert r.returncode != 0  # nothing listens on port 1; the line comes before the failure
    lines = [line for line in r.stderr.splitlines() if THREAD_LINE in line]
    expected = choose_threads(0, usable_cores(), True).threads
    assert len(lines) == 1 and lines[0].startswith(f"device-client: {expected} torch thread(s): "), r.stderr
    assert "share this host" in lines[0]
    # What silences the line is read by the command's own main, so the quiet runs go through it in this
    # process (the real process above proves the line reaches stderr); --threads 1 keeps this process's
    # torch at the one thread conftest set, and OMP_NUM_THREADS=1 makes the rule leave torch alone.
    for args, omp in ((["--threads", "1"], None), ([], "1")):
        if omp is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        rc = device_main.main(["--edge", "127.0.0.1:1", "--prompt", "w1", "--raw", "--timeout", "2",
                               "--reconnect-timeout", "0", "--draft-model", drafter, *args])
        err = capsys.readouterr().err
        assert rc != 0 and THREAD_LINE not in err and "device-client: error:" in err, err
    assert torch.get_num_threads() == 1


def test_edge_server_on_loopback_logs_its_share(edge_v512) -> None:
    """The session's shared edge-server (conftest) is started with neither --threads nor OMP_NUM_THREADS."""
    lines = [line for line in edge_v512.lines if THREAD_LINE in line]
    expected = choose_threads(0, usable_cores(), True).threads
    assert len(lines) == 1 and lines[0].startswith(f"edge-server: {expected} torch thread(s): "), edge_v512.lines
