"""The rig: one ``edge-server`` process and one device driver process for the whole run; the link between
them is reshaped between batches of jobs.

With root, :func:`testbed.netns.testbed` puts the two processes in two network namespaces joined by a
veth pair. A shaped phase puts a ``tbf`` qdisc on the uplink (device side) egress (this kernel has
no netem; no delay is asked for, so no user-space emulator sits in the path); the "loopback" phase
removes it, leaving the bare veth pair (same kernel path as ``lo``, no queue limit). Without root,
both processes run on 127.0.0.1 and only the loopback phase exists. Both processes run with one
torch thread. Keeping them up saves the ~30-60 s that starting them costs per link on shared cores.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specdec.testbed import procs
from specdec.testbed.linkemu import LinkSpec
from specdec.testbed.netns import in_ns, sent_bytes, shape, testbed

DRIVER = "specdec.bench.harness.driver"
READY_TIMEOUT_S = 600.0   # first load of the GGUF target dequantizes it; drafter load on busy cores
STOP_TIMEOUT_S = 15.0
TC_TIMEOUT_S = 10.0


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per process: shared cores


def shaping_available() -> str | None:
    """None if namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    return None


class _Proc:
    """A child process that prints a ready line with its port (edge-server on loopback)."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{cmd[0]} exited; see {log}")
            self.log.write(line)
            m = procs.PORT_RE.search(line)
            if m:
                self.port = int(m.group(1))
                return
        raise TimeoutError(f"{cmd[0]} not ready")

    def stop(self) -> None:
        _stop(self.proc)
        self.log.write(self.proc.stdout.read() or "")
        self.log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Driver:
    """The device driver process: batches of jobs in on stdin, JSON lines out."""

    def __init__(self, cmd_prefix: list[str], address: str, log: Path):
        self.err = log.open("w")
        self.proc = subprocess.Popen([*cmd_prefix, sys.executable, "-m", DRIVER, "--edge", address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=_env())
        ready = self._next()
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"device driver did not start; see {log}")
        self.draft_model = ready.get("draft_model", "")

    def _next(self) -> dict | None:
        for raw in self.proc.stdout:
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                self.err.write(raw)
        return None

    def run(self, jobs: list[dict], on_line) -> list[dict]:
        self.proc.stdin.write(json.dumps({"jobs": jobs}) + "\n")
        self.proc.stdin.flush()
        lines = []
        while True:
            line = self._next()
            if line is None:
                raise RuntimeError(f"device driver exited with {self.proc.wait()}")
            if line.get("batch_done"):
                return lines
            lines.append(line)
            on_line(line)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(self.proc)
        self.err.close()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc/PID/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of stat(5)


def _sent(ns: str, dev: str) -> int | None:
    """Bytes the root qdisc sent (None without a count: the bare veth's noqueue keeps none)."""
    try:
        return sent_bytes(ns, dev)
    except Exception:
        return None


class Rig:
    """Edge + driver for the whole run; ``set_link`` shapes the link, ``run`` runs a batch of jobs over it."""

    def __init__(self, logs: Path, shaped: bool):
        self.logs = logs
        self.shaped = shaped
        self.shaper = "none"
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Rig":
        try:
            if self.shaped:
                self.tb = self._stack.enter_context(testbed(LinkSpec(), LinkSpec()))
                started: list[procs.NsProcess] = []
                self._stack.callback(self._stop_ns, started)
                port = procs.start_edge(self.tb, [], started)
                self.edge_pid = started[0].proc.pid  # `ip netns exec` execs the command: same pid
                address = procs.device_side_address(self.tb, port, started)
                prefix = in_ns(self.tb.pair.device_ns)
            else:
                edge = _Proc([str(procs.BIN / "edge-server"), "--host", "127.0.0.1", "--port", "0", "--threads", "1"],
                             self.logs / "edge.log")
                self._stack.callback(edge.stop)
                address, prefix = f"127.0.0.1:{edge.port}", []
                self.edge_pid = edge.proc.pid
            self.driver = Driver(prefix, address, self.logs / "driver.log")
            self._stack.callback(self.driver.stop)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _stop_ns(self, started) -> None:
        with contextlib.suppress(Exception):
            (self.logs / "edge.log").write_text("".join(started[0].lines) if started else "")
        procs.stop_all(started)

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def draft_model(self) -> str:
        return self.driver.draft_model

    def _set_rate(self, ns: str, dev: str, rate_bps: float) -> None:
        if rate_bps > 0:
            shape(ns, dev, LinkSpec(rate_bps=rate_bps), use_netem=False)  # tc qdisc replace ... tbf
        else:
            subprocess.run(in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root"), capture_output=True,
                           timeout=TC_TIMEOUT_S)  # back to the bare veth; fails harmlessly if none

    def set_link(self, rate_bps: float, down_rate_bps: float) -> None:
        """tbf at these rates on the two egresses (0 = none); counters restart with the new qdiscs."""
        if not self.shaped:
            if rate_bps or down_rate_bps:
                raise RuntimeError("shaped links need the namespaces (root)")
            return
        pair = self.tb.pair
        self._set_rate(pair.device_ns, pair.device_if, rate_bps)
        self._set_rate(pair.edge_ns, pair.edge_if, down_rate_bps)
        self.shaper = "tbf" if (rate_bps or down_rate_bps) else "none"

    def wire_bytes(self) -> tuple[int | None, int | None]:
        """(uplink, downlink) bytes the current qdiscs sent; None where the link is not shaped."""
        if not self.shaped:
            return None, None
        pair = self.tb.pair
        return _sent(pair.device_ns, pair.device_if), _sent(pair.edge_ns, pair.edge_if)

    def run(self, jobs: list[dict], on_line) -> list[dict]:
        return self.driver.run(jobs, on_line)

    def cpu_seconds(self) -> float:
        """CPU time the edge and the driver have used so far (all their threads): what our system
        costs in compute, whatever else runs on the cores."""
        return sum(_cpu_seconds(pid) for pid in (self.edge_pid, self.driver.proc.pid))
