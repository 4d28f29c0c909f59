"""The rig every benchmark runs on: ``edge-server`` processes, device driver processes
(:mod:`specdec.bench.harness.driver`), and the link between them, all up for a whole run.

:class:`Rig` joins one edge and one driver over a chosen link:

- ``loopback``: both on 127.0.0.1 (no root needed);
- ``tbf``: with root, :func:`testbed.netns.testbed` puts them in two network namespaces joined by a
  veth pair; :meth:`Rig.set_rates` puts a ``tbf`` qdisc on each direction's egress (this kernel has
  no netem) or removes it, leaving the bare veth pair (the same kernel path as ``lo``);
- ``emulated``: the same namespaces with the userspace emulator (testbed/linkemu.py) between driver
  and edge in the device namespace, reconfigured live over its control socket
  (:meth:`Rig.set_emulator`: delay, jitter, loss, and the rate when tbf is off), so the driver's
  gRPC channel stays up while the link changes.

Every process gets one torch thread (the cores are shared). Keeping them up saves the ~30-60 s that
starting them costs per link on shared cores. :class:`Edge` and :class:`Drivers` serve benchmarks
that need several edges or several real devices at once (bench-capacity).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from specdec.testbed import procs
from specdec.testbed.linkemu import LinkSpec, send_control
from specdec.testbed.netns import EDGE_IP, in_ns, sent_bytes, shape, testbed

DRIVER = "specdec.bench.harness.driver"
SLOW_EDGE, SLOW_EDGE_FLAG = "specdec.bench.harness.slow_edge", "--target-slowdown"
READY_TIMEOUT_S = 600.0   # first load of the GGUF target dequantizes it; drafter load on busy cores
STOP_TIMEOUT_S = 15.0
TC_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 10.0
LINKS = ("loopback", "tbf", "emulated")


def shaping_available() -> str | None:
    """None if namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    return None


class Edge(procs.ReadyProcess):
    """One ``edge-server`` (or ``exe``, a command taking its flags) on loopback with one torch thread
    (``threads``), optionally pinned to ``cpus`` (taskset) and with its /metrics on a port of its own;
    its output goes to ``log`` (if given) when it stops."""

    def __init__(self, *args: str, log: Path | None = None, threads: int = 1, cpus: tuple[int, ...] = (),
                 metrics: bool = False, env: dict[str, str] | None = None, lines=None, exe: list[str] | None = None):
        self.log_path = log
        self.metrics_port = procs.free_port() if metrics else None
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        extra = ["--metrics-port", str(self.metrics_port)] if metrics else []
        super().__init__(pin + procs.edge_server_cmd("--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
                                                     *extra, *args, exe=exe),
                         name="edge-server", ready_re=procs.EDGE_READY_RE,
                         ready_timeout=READY_TIMEOUT_S, env=env, lines=lines)

    def metrics(self) -> str | None:
        """Its /metrics text, None if it has none or does not answer."""
        if self.metrics_port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=METRICS_TIMEOUT_S) as r:
                return r.read().decode()
        except OSError:
            return None

    def sessions_active(self) -> float:
        """Sessions it serves now, from its /metrics (0 if it has none or does not answer)."""
        line = next((l for l in (self.metrics() or "").splitlines()
                     if l.startswith("specdec_edge_sessions_active ")), None)
        return float(line.split()[1]) if line else 0.0

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        code = super().stop()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.write_text("".join(self.lines))
        return code


class Driver:
    """A device driver process: batches of jobs in on stdin, JSON lines out (see its module)."""

    def __init__(self, cmd_prefix: list[str], address: str, log: Path, args: tuple[str, ...] = ()):
        self.err = log.open("w")
        self.proc = subprocess.Popen([*cmd_prefix, sys.executable, "-m", DRIVER, "--edge", address, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=procs.child_env())
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
        """Run one batch; ``on_line`` sees each line as it comes; returns them all."""
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
            self.proc.kill()
            self.proc.wait()
        self.err.close()


class Drivers:
    """``n`` device drivers against one edge, started at once; :meth:`run` runs ``jobs[i]`` on
    driver i, all at the same time. ``args(i)``: driver i's extra arguments (e.g. its own drafter)."""

    def __init__(self, address: str, n: int, logs: Path, args=lambda i: (), cmd_prefix: list[str] = ()):
        slots: list[Driver | None] = [None] * n
        starters = [threading.Thread(target=self._start, args=(slots, i, address, logs / f"driver-{i}.log",
                                                               tuple(args(i)), list(cmd_prefix)))
                    for i in range(n)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        self.drivers: list[Driver] = [d for d in slots if d is not None]
        if len(self.drivers) != n:
            self.stop()
            raise RuntimeError(f"a device driver did not start; see {logs}")

    @staticmethod
    def _start(slots: list, i: int, address: str, log: Path, args: tuple[str, ...], cmd_prefix: list[str]) -> None:
        with contextlib.suppress(Exception):
            slots[i] = Driver(cmd_prefix, address, log, args)

    def run(self, jobs: list[dict]) -> list[dict]:
        """Every session line of every driver."""
        lines: list[list[dict]] = [[] for _ in jobs]
        threads = [threading.Thread(target=lambda i=i: lines[i].extend(self.drivers[i].run([jobs[i]], lambda _: None)))
                   for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [x for ls in lines for x in ls]

    def stop(self) -> None:
        for d in self.drivers:
            d.stop()


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
    """Edge + driver for a whole run over a ``link`` of :data:`LINKS`; :meth:`run` runs a batch of
    jobs over the link as it is now."""

    def __init__(self, logs: Path, link: str = "loopback", driver: bool = True, target_slowdown: float = 1.0):
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        self.logs = logs
        self.link = link
        self.with_driver = driver  # False: the benchmark runs its own device processes (device_cmd)
        self.shaper = "none"
        self.control = ""
        # a slower edge (slow_edge): the edge-server command with the flag that slows its target
        self.edge_exe = procs.python_module(SLOW_EDGE, SLOW_EDGE_FLAG, f"{target_slowdown:g}") \
            if target_slowdown != 1.0 else None
        self._started: list[procs.NsProcess] = []
        self._stack = contextlib.ExitStack()

    @property
    def namespaces(self) -> bool:
        return self.link != "loopback"

    def __enter__(self) -> "Rig":
        try:
            if self.namespaces:
                address, prefix = self._start_in_namespaces()
            else:
                edge = Edge(log=self.logs / "edge.log", exe=self.edge_exe)
                self._stack.callback(edge.stop)
                address, prefix, self.edge_pid = edge.address, [], edge.proc.pid
            self.device_address, self.device_prefix = address, prefix
            if self.with_driver:
                self.driver = Driver(prefix, address, self.logs / "driver.log")
                self._stack.callback(self.driver.stop)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start_in_namespaces(self) -> tuple[str, list[str]]:
        """Edge in the edge namespace, the emulator (if any) in the device namespace; the address
        the driver dials and the prefix that runs it in the device namespace."""
        self.tb = self._stack.enter_context(testbed(LinkSpec(), LinkSpec()))
        self._stack.callback(self._stop_ns)
        port = procs.start_edge(self.tb, [], self._started, self.edge_exe)
        self.edge_pid = self._started[0].proc.pid  # `ip netns exec` execs the command: same pid
        prefix = in_ns(self.tb.pair.device_ns)
        if self.link == "tbf":
            return procs.device_side_address(self.tb, port, self._started), prefix
        sock_dir = Path(tempfile.mkdtemp(prefix="sdlinks-"))  # short: unix socket paths <= 107 bytes
        self._stack.callback(shutil.rmtree, sock_dir, True)
        self.control = f"unix:{sock_dir / 'ctl.sock'}"
        emu = procs.NsProcess(self.tb.pair.device_ns, *procs.python_module(
            "specdec.testbed.linkemu", "--listen", "127.0.0.1:0", "--connect", f"{EDGE_IP}:{port}",
            "--control", self.control), name="linkemu")
        self._started.append(emu)
        return f"127.0.0.1:{emu.port}", prefix

    def _stop_ns(self) -> None:
        for proc, log in zip(self._started, ("edge.log", "linkemu.log")):
            with contextlib.suppress(Exception):
                (self.logs / log).write_text("".join(proc.lines))
        procs.stop_all(self._started)

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

    def set_rates(self, up_bps: float, down_bps: float) -> None:
        """tbf at these rates on the two egresses (0 = none); counters restart with the new qdiscs."""
        if not self.namespaces:
            if up_bps or down_bps:
                raise RuntimeError("shaped links need the namespaces (root)")
            return
        pair = self.tb.pair
        self._set_rate(pair.device_ns, pair.device_if, up_bps)
        self._set_rate(pair.edge_ns, pair.edge_if, down_bps)
        self.shaper = "tbf" if (up_bps or down_bps) else "none"

    def set_emulator(self, message: dict) -> dict:
        """Reconfigure the emulator (``emulated`` links): {"uplink": {...}, "downlink": {...}}."""
        if self.link != "emulated":
            raise RuntimeError(f"a {self.link} link has no emulator")
        return send_control(self.control, message)

    def wire_bytes(self) -> tuple[int | None, int | None]:
        """(uplink, downlink) bytes the current qdiscs sent; None where the link is not shaped."""
        if not self.namespaces:
            return None, None
        pair = self.tb.pair
        return _sent(pair.device_ns, pair.device_if), _sent(pair.edge_ns, pair.edge_if)

    def run(self, jobs: list[dict], on_line) -> list[dict]:
        return self.driver.run(jobs, on_line)

    def device_cmd(self, *args: str) -> list[str]:
        """``device-client`` where the device runs (its namespace), dialling the edge over the link."""
        return [*self.device_prefix, *procs.device_cmd(self.device_address, list(args))]

    def cpu_seconds(self) -> float:
        """CPU time the edge and the driver have used so far (all their threads): what our system
        costs in compute, whatever else runs on the cores."""
        return sum(_cpu_seconds(pid) for pid in (self.edge_pid, self.driver.proc.pid))
