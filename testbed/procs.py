"""Processes inside the testbed's namespaces: started with ``ip netns exec``, ready lines, cleanup."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from testbed.linkemu import LinkSpec
from testbed.netns import DEVICE_IP, EDGE_IP, Testbed, in_ns
from testbed.units import tc_time

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent   # edge-server / device-client of this environment
READY_TIMEOUT_S = 300.0             # the embedded GGUF target dequantizes for ~20-30 s at first load
STOP_TIMEOUT_S = 15.0
PORT_RE = re.compile(r"(?:listening|ready) on [\w.:\[\]-]*?:(\d+)")


def child_env(testbed_module: bool = False) -> dict[str, str]:
    """One torch thread per process: the two ends share the cores of one machine. Only the
    testbed's own modules get the repo root on their path (the product imports ``specdec.*``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if testbed_module:
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


class NsProcess:
    """A long-running process in a namespace that prints a ready line with its port."""

    def __init__(self, ns: str, *cmd: str, name: str, testbed_module: bool = False):
        self.name = name
        self.proc = subprocess.Popen(in_ns(ns, *cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=child_env(testbed_module))
        self.lines: list[str] = []
        self.port = self._wait_ready()
        # Keep draining its output so a chatty process never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited:\n" + "".join(self.lines))
            self.lines.append(line)
            m = PORT_RE.search(line)
            if m:
                return int(m.group(1))
        raise TimeoutError(f"{self.name} not ready:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
        "testbed.linkemu", "--listen", "127.0.0.1:0", "--connect", f"{EDGE_IP}:{edge_port}",
        *linkemu_args(tb.uplink, tb.downlink)), name="linkemu", testbed_module=True)
    started.append(emu)
    return f"127.0.0.1:{emu.port}"


def start_probe_server(tb: Testbed, started: list[NsProcess]) -> int:
    probe = NsProcess(tb.pair.edge_ns, *python_module("testbed.probe", "serve", "--listen", f"{EDGE_IP}:0"),
                      name="probe", testbed_module=True)
    started.append(probe)
    return probe.port


def start_edge(tb: Testbed, edge_args: list[str], started: list[NsProcess]) -> int:
    edge = NsProcess(tb.pair.edge_ns, str(BIN / "edge-server"), "--host", EDGE_IP, "--port", "0",
                     "--threads", "1", *edge_args, name="edge-server")
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


__all__ = ["NsProcess", "DEVICE_IP", "EDGE_IP", "device_side_address", "start_probe_server",
           "start_edge", "run_in_device_ns", "device_cmd", "stop_all"]
