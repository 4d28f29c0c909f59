"""Long-running child processes (edge-server, the link emulator, the probe): started, awaited until
their ready line gives the port, stopped. :class:`ReadyProcess` is the one launcher the testbed,
the integration tests (tests/support/harness.py) and bench/soak.py use; :class:`NsProcess` runs
one inside a testbed namespace (``ip netns exec``)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from specdec.testbed.linkemu import LinkSpec
from specdec.testbed.netns import DEVICE_IP, EDGE_IP, Testbed, in_ns
from specdec.testbed.units import tc_time

BIN = Path(sys.executable).parent   # edge-server / device-client of this environment
READY_TIMEOUT_S = 300.0             # the embedded GGUF target dequantizes for ~20-30 s at first load
STOP_TIMEOUT_S = 30.0               # edge-server gives in-flight rounds 5 s on SIGTERM; slack for busy cores
PORT_RE = re.compile(r"(?:listening|ready) on [\w.:\[\]-]*?:(\d+)")
# edge-server's own line ("edge-server ready on HOST:PORT model=..."); the port is after the last
# colon of the address, which may be IPv6.
EDGE_READY_RE = re.compile(r"ready on \S*:(\d+)")


def free_port() -> int:
    """A loopback port free right now, for a child to bind (a /metrics endpoint, a fake server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """One torch thread per process: the two ends share the cores of one machine. ``extra``
    overrides variables; a None value unsets one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


class ReadyProcess:
    """A long-running child that prints a ready line with its port: started, awaited, stopped.

    Its output (stdout and stderr) is kept in ``lines``: up to the ready line, then, if ``drain``,
    all of it, read by a thread so that a chatty child never blocks on a full pipe. Without
    ``drain`` the caller reads ``proc.stdout`` itself. ``lines`` may be a bounded deque.
    """

    def __init__(self, cmd: list[str], *, name: str, env: dict[str, str] | None = None,
                 ready_re: re.Pattern = PORT_RE, ready_timeout: float = READY_TIMEOUT_S,
                 cwd: Path | None = None, drain: bool = True, lines=None):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env() if env is None else env, cwd=cwd)
        self.lines = [] if lines is None else lines
        self.port = self._wait_ready(ready_re, ready_timeout)
        if drain:
            threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, ready_re: re.Pattern, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited:\n" + "".join(self.lines))
            self.lines.append(line)
            m = ready_re.search(line)
            if m:
                return int(m.group(1))
        raise TimeoutError(f"{self.name} not ready:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def address(self) -> str:
        """Its port on loopback (a process in a namespace is reached at that namespace's IP)."""
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; its exit status (0 after a graceful stop)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class NsProcess(ReadyProcess):
    """A :class:`ReadyProcess` inside a testbed namespace."""

    def __init__(self, ns: str, *cmd: str, name: str):
        super().__init__(in_ns(ns, *cmd), name=name, env=child_env())


def edge_server_cmd(*args: str, bindir: Path = BIN, exe: list[str] | None = None) -> list[str]:
    """``edge-server`` of this environment (or of ``bindir``), or ``exe`` (a command that takes its
    flags, e.g. the bench's slower edge), with ``args``."""
    return [*(exe or [str(bindir / "edge-server")]), *args]


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def linkemu_args(uplink: LinkSpec, downlink: LinkSpec) -> list[str]:
    """Delay, jitter and loss for the emulator; the rate stays with tbf in the kernel."""
    args = []
    for side, spec in (("up", uplink), ("down", downlink)):
        args += [f"--{side}-delay", tc_time(spec.delay_s), f"--{side}-jitter", tc_time(spec.jitter_s),
                 f"--{side}-loss", f"{spec.loss!r}"]
    return args


def device_side_address(tb: Testbed, edge_port: int, started: list[NsProcess]) -> str:
    """The address the device dials: the edge itself, or a link emulator in front of it."""
    if not tb.needs_emulator:
        return f"{EDGE_IP}:{edge_port}"
    emu = NsProcess(tb.pair.device_ns, *python_module(
        "specdec.testbed.linkemu", "--listen", "127.0.0.1:0", "--connect", f"{EDGE_IP}:{edge_port}",
        *linkemu_args(tb.uplink, tb.downlink)), name="linkemu")
    started.append(emu)
    return f"127.0.0.1:{emu.port}"


def start_probe_server(tb: Testbed, started: list[NsProcess]) -> int:
    probe = NsProcess(tb.pair.edge_ns, *python_module("specdec.testbed.probe", "serve", "--listen", f"{EDGE_IP}:0"),
                      name="probe")
    started.append(probe)
    return probe.port


def start_edge(tb: Testbed, edge_args: list[str], started: list[NsProcess], exe: list[str] | None = None) -> int:
    """``edge-server`` (or ``exe``, a command taking its flags) in the edge namespace; its port."""
    edge = NsProcess(tb.pair.edge_ns, *edge_server_cmd("--host", EDGE_IP, "--port", "0", "--threads", "1",
                                                       *edge_args, exe=exe), name="edge-server")
    started.append(edge)
    return edge.port


def run_in_device_ns(tb: Testbed, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(in_ns(tb.pair.device_ns, *cmd), capture_output=True, text=True,
                          timeout=timeout, env=child_env())


def device_cmd(address: str, device_args: list[str]) -> list[str]:
    return [str(BIN / "device-client"), "--edge", address, "--threads", "1", *device_args]


def stop_all(started: list[NsProcess]) -> None:
    for p in reversed(started):
        p.stop()


__all__ = ["ReadyProcess", "NsProcess", "DEVICE_IP", "EDGE_IP", "device_side_address", "start_probe_server",
           "start_edge", "run_in_device_ns", "device_cmd", "stop_all"]
