"""Debian's HAProxy in front of three edge-servers on loopback, run with the committed
deploy/haproxy/haproxy.cfg as it is: only its environment variables name the addresses. The fleet
tests and ``make bench-fleet`` start it; ``.ci/system-deps.sh`` installs it."""
from __future__ import annotations

import collections
import os
import re
import shutil
import socket
import subprocess
import threading
import time

from pathlib import Path

from specdec.testbed.procs import free_port

# The checkout's deploy/ (the testbed runs from a checkout: an editable install).
CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy" / "haproxy.cfg"
EDGES = 3                 # the committed config names three edges
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOG_LINES = 5000


def binary() -> str:
    path = shutil.which("haproxy") or "/usr/sbin/haproxy"  # /usr/sbin: not on every PATH
    if not os.path.exists(path):
        raise RuntimeError("haproxy is not installed: run .ci/system-deps.sh (Debian: apt-get install haproxy)")
    return path


class Proxy:
    """``haproxy -db -f deploy/haproxy/haproxy.cfg``; ``edges``: (gRPC address, probe port) of three
    edges (an address nobody listens on leaves that slot down). ``cpus``: taskset it there."""

    def __init__(self, edges: list[tuple[str, int]], cpus: tuple[int, ...] = ()):
        assert len(edges) == EDGES, "the committed config names three edges"
        self.port = free_port()
        env = {**os.environ, "SPECDEC_PROXY_BIND": f"127.0.0.1:{self.port}"}
        for i, (address, probe_port) in enumerate(edges, 1):
            env[f"SPECDEC_EDGE{i}"] = address
            env[f"SPECDEC_EDGE{i}_PROBE"] = str(probe_port)
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.proc = subprocess.Popen([*pin, binary(), "-db", "-f", str(CONFIG)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_listening()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("haproxy exited:\n" + "".join(self.log))
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("haproxy not listening:\n" + "".join(self.log))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_for(self, pattern: str, timeout: float = 10.0) -> bool:
        """Whether a log line matching ``pattern`` appears within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            if any(rx.search(line) for line in list(self.log)):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
