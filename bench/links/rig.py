"""The rig of bench-links: edge-server and the device driver in two network namespaces, the
userspace link emulator between them (in the device namespace, with a live control socket), tbf on
both veth egresses for the rate.

    [ns dev] driver -> linkemu (delay, jitter, loss; rate only on the changing link) -> veth (tbf up)
                                                                         -> [ns edge] edge-server
             <------------------------------------------------------------ veth (tbf down)

One edge, one emulator and one driver for the whole run: the driver's gRPC channel stays connected
while the link changes (tbf is replaced between cells; the emulator is told over its control socket,
a unix socket, which the benchmark in the root namespace can reach). The emulator is in the path on
every link, RTT 0 included, so all cells share the same path and its small proxy cost.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

from specdec.bench.harness import rig as harness_rig
from specdec.testbed import procs
from specdec.testbed.linkemu import LinkSpec, send_control
from specdec.testbed.netns import EDGE_IP, in_ns, testbed

DRIVER = "specdec.bench.links.driver"


class Driver(harness_rig.Driver):
    """bench/suite/links.py's Driver running bench/links/driver.py (round end times in each record)."""

    def __init__(self, cmd_prefix: list[str], address: str, log: Path):
        import subprocess

        self.err = log.open("w")
        self.proc = subprocess.Popen([*cmd_prefix, sys.executable, "-m", DRIVER, "--edge", address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=harness_rig._env())
        ready = self._next()
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"device driver did not start; see {log}")
        self.draft_model = ready.get("draft_model", "")


class LinksRig(harness_rig.Rig):
    """Edge + emulator + driver; :meth:`set_link` reshapes tbf and the emulator without restarts."""

    def __init__(self, logs: Path):
        super().__init__(logs, shaped=True)
        self.control = ""
        self.emulator_rate = False

    def __enter__(self) -> "LinksRig":
        try:
            self.tb = self._stack.enter_context(testbed(LinkSpec(), LinkSpec()))
            started: list[procs.NsProcess] = []
            self._stack.callback(self._stop_ns, started)
            port = procs.start_edge(self.tb, [], started)
            self.edge_pid = started[0].proc.pid
            sock_dir = Path(tempfile.mkdtemp(prefix="sdlinks-"))  # short: unix socket paths <= 107 bytes
            self._stack.callback(shutil.rmtree, sock_dir, True)
            self.control = f"unix:{sock_dir / 'ctl.sock'}"
            emu = procs.NsProcess(self.tb.pair.device_ns, *procs.python_module(
                "specdec.testbed.linkemu", "--listen", "127.0.0.1:0", "--connect", f"{EDGE_IP}:{port}",
                "--control", self.control), name="linkemu")
            started.append(emu)
            self.driver = Driver(in_ns(self.tb.pair.device_ns), f"127.0.0.1:{emu.port}", self.logs / "driver.log")
            self._stack.callback(self.driver.stop)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _stop_ns(self, started) -> None:
        with contextlib.suppress(Exception):
            (self.logs / "edge.log").write_text("".join(started[0].lines) if started else "")
        with contextlib.suppress(Exception):
            (self.logs / "linkemu.log").write_text("".join(started[1].lines) if len(started) > 1 else "")
        procs.stop_all(started)

    def set_emulator(self, message: dict) -> dict:
        return send_control(self.control, message)

    def set_link(self, link, emulator_rate: bool = False) -> None:  # link: plan.Link
        """tbf at the link's rates (or none, when the emulator carries the rate), then the emulator."""
        if emulator_rate:
            super().set_link(0.0, 0.0)
        else:
            super().set_link(link.up_bps, link.down_bps)
        self.emulator_rate = emulator_rate
        self.set_emulator(link.emulator(with_rate=emulator_rate))
