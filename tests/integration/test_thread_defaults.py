"""Both commands with no thread flag: on a shared host each takes its share of the cores and says so
in one line; --threads and OMP_NUM_THREADS silence the rule."""
from __future__ import annotations

import os
import subprocess

from tests.support.harness import VENV_BIN, EdgeProcess
from specdec.common.runtime import choose_threads, usable_cores

THREAD_LINE = "torch thread(s):"


def _env_without_omp() -> dict:
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _device(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "device-client"), "--edge", "127.0.0.1:1", "--prompt", "w1", "--raw",
                           "--timeout", "2", "--reconnect-timeout", "0", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def test_device_client_logs_its_share_of_a_shared_host(tiny_pair_v512) -> None:
    drafter = str(tiny_pair_v512[1])
    r = _device("--draft-model", drafter, env=_env_without_omp())
    assert r.returncode != 0  # nothing listens on port 1; the line comes before the failure
    lines = [line for line in r.stderr.splitlines() if THREAD_LINE in line]
    expected = choose_threads(0, usable_cores(), True).threads
    assert len(lines) == 1 and lines[0].startswith(f"device-client: {expected} torch thread(s): "), r.stderr
    assert "share this host" in lines[0]
    for quiet in (_device("--draft-model", drafter, "--threads", "1", env=_env_without_omp()),
                  _device("--draft-model", drafter, env={**os.environ, "OMP_NUM_THREADS": "1"})):
        assert THREAD_LINE not in quiet.stderr and quiet.returncode != 0


def test_edge_server_on_loopback_logs_its_share(tiny_pair_v512) -> None:
    edge = EdgeProcess("--model", str(tiny_pair_v512[0]), env={"OMP_NUM_THREADS": None})
    try:
        lines = [line for line in edge.lines if THREAD_LINE in line]
    finally:
        assert edge.stop() == 0
    expected = choose_threads(0, usable_cores(), True).threads
    assert len(lines) == 1 and lines[0].startswith(f"edge-server: {expected} torch thread(s): "), edge.lines
