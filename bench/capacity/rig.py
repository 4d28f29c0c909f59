"""The processes of bench-capacity: edge-server processes (one per edge kind, up for the whole run,
each with its /metrics), the recorder, and real device drivers for the validation.

Every edge gets one torch thread by default (the two cores are shared with the load generator and,
during the validation, with real drafters; ``--edge-threads``) and no per-principal session cap: all clients of the load
generator are one host, which the default cap (half of --max-sessions) would count as one principal.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from specdec.bench.harness import rig as harness_rig
from specdec.testbed import procs

from specdec.bench.capacity import plan

RECORD = "specdec.bench.capacity.record"
EDGE_COMMON = ("--port", "0", "--max-sessions-per-principal", "0")
METRICS_TIMEOUT_S = 10.0
RECORD_TIMEOUT_S = 3600.0


def run_dir(results: Path, name: str) -> Path:
    """``results/name`` (with logs/), and ``results/latest`` pointing at it, swapped in atomically."""
    out = results / name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tmp = results / f".latest-{name}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    os.replace(tmp, results / "latest")
    return out


def edge_flags() -> set[str]:
    """The long flags this environment's edge-server accepts (from its --help)."""
    out = subprocess.run(procs.edge_server_cmd("--help"), capture_output=True, text=True, timeout=120)
    return {w.strip("[],") for w in out.stdout.split() if w.startswith(("--", "[--"))}


def free_port() -> int:
    from specdec.bench.soak import _free_port
    return _free_port()


class Edge(procs.ReadyProcess):
    """One edge-server of a kind (plan.EDGES) on loopback with /metrics on its own port."""

    def __init__(self, kind: str, logs: Path, threads: int = 1, cpus: tuple[int, ...] = ()):
        self.kind = kind
        self.metrics_port = free_port()
        self.log_path = logs / f"edge-{kind}.log"
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []  # plan.Settings.edge_cpus: why
        super().__init__(pin + procs.edge_server_cmd(*EDGE_COMMON, "--threads", str(threads),
                                                     "--metrics-port", str(self.metrics_port),
                                                     *plan.EDGES[kind]["args"]),
                         name=f"edge-server ({kind})", ready_re=procs.EDGE_READY_RE)

    def metrics(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=METRICS_TIMEOUT_S) as r:
                return r.read().decode()
        except OSError:
            return None

    def stop(self) -> int:
        code = super().stop()
        with contextlib.suppress(OSError):
            self.log_path.write_text("".join(self.lines))
        return code


def record(address: str, jobs: list[dict], log: Path, on_line) -> None:
    """Run the recorder (record.py) over ``jobs``; raises if it fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", RECORD, "--edge", address, "--jobs", f.name],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=harness_rig._env())
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                on_line(json.loads(line))
        if proc.wait(timeout=RECORD_TIMEOUT_S):
            raise RuntimeError(f"recorder failed ({proc.returncode}); see {log}")
    Path(f.name).unlink(missing_ok=True)


class Drivers:
    """``n`` real device drivers (bench/suite/driver.py: the default drafter, device/client.generate)
    against one edge; :meth:`run` runs one job on each of the first ``k`` at once."""

    def __init__(self, address: str, n: int, logs: Path):
        self.drivers: list[harness_rig.Driver] = []
        starters = [threading.Thread(target=self._start, args=(address, logs / f"driver-{i}.log"))
                    for i in range(n)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if len(self.drivers) != n:
            self.stop()
            raise RuntimeError(f"a device driver did not start; see {logs}")

    def _start(self, address: str, log: Path) -> None:
        with contextlib.suppress(Exception):
            self.drivers.append(harness_rig.Driver([], address, log))

    def run(self, jobs: list[dict]) -> list[dict]:
        """jobs[i] on driver i, all at once; every session line of every driver."""
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
