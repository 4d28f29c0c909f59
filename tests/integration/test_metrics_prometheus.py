"""A real Prometheus scrapes a real edge-server and device-client; every dashboard query returns data.

The Prometheus server is Debian's ``prometheus`` binary (``.ci/run`` installs it), on loopback with
its own temporary config (built from ``deploy/prometheus/prometheus.yml`` with the targets pointed
at the two processes) and data directory. The device runs many short sessions, so that several
scrapes land during the run, and ``--linger`` keeps its ``/metrics`` up until the queries are done.
Every PromQL expression of every panel of every dashboard JSON is then evaluated through
``/api/v1/query`` and must return at least one finite sample.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.harness import VENV_BIN, EdgeProcess
from specdec.common import protocol as P
from specdec.common.stats import RoundRecord, edge_record
from specdec.device.metrics import DeviceMetrics
from specdec.edge.metrics import EdgeMetrics
from specdec.testbed import procs

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL = "1s"  # short: a run of a few seconds then yields several samples per series
# Grafana's variables, as the test substitutes them. The range covers the whole short run (as a
# dashboard's time range would after a run), so rate() sees the counters' increase.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "1s",
                     "${__interval}": "1s", "$interval": "1s", "$__range": "1m", "${__range}": "1m"}
NUM_SESSIONS = 100      # ~30-60 ms each on 2 cores: the run spans several scrapes
LINGER_S = 120          # upper bound; the test stops the device as soon as the queries are done
READY_TIMEOUT_S = 60.0
QUERY_DEADLINE_S = 45.0  # for every dashboard query to show data after the device's run
JOB_TARGETS = {"specdec-edge": "edge", "specdec-device": "device"}


def _grafana_to_promql(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows nest their panels


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title / refId, PromQL) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in _panels(dash["panels"]):
            for target in panel.get("targets", []):
                out.append((path.name, f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


# -- fast checks (no Prometheus needed) -----------------------------------------------------------

def _exported_names() -> set[str]:
    """Every sample name the two processes export after one round and one request."""
    edge, device = EdgeMetrics(), DeviceMetrics()
    edge.set_model("m", 8)
    edge.session_started("tslt")
    device.session_started("tslt")
    device.fleet_welcomed("edge1", None, False)  # the session's Welcome: the edge it runs on
    device.tokens_delivered("tslt", 2)
    edge.observe_round(edge_record(P.DraftBlock(1, (1, 2)), P.Verdict(1, 1, 3), "tslt", 20, 10))
    edge.request_done("tslt", 0.1, 2)
    device.observe_round(RoundRecord(mode="tslt", drafted_tokens=2, positions=2, accepted=1, generated=2,
                                     uplink_bytes=20, downlink_bytes=10, phases={"draft": 0.01},
                                     support_sizes=(4,), threshold=0.1))
    device.request_done("tslt", 0.1, 2)
    return {s.name for m in [*edge.registry.collect(), *device.registry.collect()] for s in m.samples}


def test_dashboards_exist_and_query_only_exported_metrics() -> None:
    assert DASHBOARDS, "no dashboard JSON under deploy/grafana/dashboards"
    queries = dashboard_queries()
    assert len(queries) >= 20
    exported = _exported_names()
    for name, panel, expr in queries:
        used = set(re.findall(r"\bspecdec_[a-z_]+", expr))
        assert used, f"{name}: {panel} queries no specdec metric"
        assert used <= exported, f"{name}: {panel} uses unknown {sorted(used - exported)}"


def test_metric_names_follow_the_convention() -> None:
    for name in _exported_names():
        assert re.fullmatch(r"specdec_(edge|device)_[a-z0-9_]+", name), name
        assert "__" not in name and ":" not in name, name


# -- the real thing -------------------------------------------------------------------------------

def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed; .ci/run installs Debian's prometheus package")
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    return path


def _write_config(path: Path, targets: dict[str, str]) -> None:
    """deploy/prometheus/prometheus.yml with a short interval and the jobs pointed at loopback."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL)
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert set(jobs) == set(JOB_TARGETS), f"deploy config jobs changed: {sorted(jobs)}"
    for job_name, role in JOB_TARGETS.items():
        jobs[job_name]["static_configs"][0]["targets"] = [targets[role]]
    path.write_text(yaml.safe_dump(cfg))


class Prometheus:
    """``prometheus`` on 127.0.0.1:<free port> with its own config and data dir."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]):
        config = workdir / "prometheus.yml"
        _write_config(config, targets)
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {Path(self.log.name).read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def query(self, promql: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        result = body["data"]["result"]
        return result if body["data"]["resultType"] in ("vector", "matrix") else [{"value": result}]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class DeviceProcess:
    """``device-client --json --linger`` as a subprocess; collects its JSON lines on a thread."""

    def __init__(self, *args: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([str(VENV_BIN / "device-client"), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.records: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                self.records.append(json.loads(line))

    def wait_records(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records) < n and time.monotonic() < deadline:
            if self.proc.poll() is not None and len(self.records) < n:
                raise RuntimeError(f"device-client exited {self.proc.returncode}: {self.proc.stderr.read()}")
            time.sleep(0.1)
        assert len(self.records) >= n, f"{len(self.records)}/{n} sessions after {timeout} s"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # ends the linger early
        self.proc.wait(timeout=30)


def _has_finite_value(result: list[dict]) -> bool:
    for series in result:
        values = series.get("values") or [series["value"]]
        if any(math.isfinite(float(v[1])) for v in values):
            return True
    return False


def _missing(prom: Prometheus, queries) -> list[str]:
    return [f"{name}: {panel}: {expr}" for name, panel, expr in queries
            if not _has_finite_value(prom.query(_grafana_to_promql(expr)))]


def test_every_dashboard_query_returns_data_from_a_real_run(tiny_pair_v8, tmp_path) -> None:
    binary = _prometheus_binary()
    target_dir, drafter_dir = tiny_pair_v8
    edge_metrics, device_metrics = procs.free_port(), procs.free_port()
    targets = {"edge": f"127.0.0.1:{edge_metrics}", "device": f"127.0.0.1:{device_metrics}"}
    prom = Prometheus(binary, tmp_path, targets)
    edge = device = None
    try:
        edge = EdgeProcess("--model", str(target_dir), "--metrics-port", str(edge_metrics), "--threads", "1")
        device = DeviceProcess(
            "--edge", edge.address, "--draft-model", str(drafter_dir), "--prompt", "w1 w2 w3", "--raw",
            "--mode", "csqs", "--temperature", "1", "--draft-len", "3", "--max-new-tokens", "24",
            "--num-samples", str(NUM_SESSIONS), "--json", "--threads", "1",
            "--metrics-port", str(device_metrics), "--linger", str(LINGER_S))
        device.wait_records(NUM_SESSIONS, timeout=240)
        queries = dashboard_queries()
        deadline = time.monotonic() + QUERY_DEADLINE_S
        missing = _missing(prom, queries)
        while missing and time.monotonic() < deadline:
            time.sleep(1.0)
            missing = _missing(prom, queries)
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
        _check_totals(prom, device.records)
    finally:
        for proc in (device, edge):
            if proc is not None:
                proc.stop()
        prom.stop()


def _check_totals(prom: Prometheus, records: list[dict]) -> None:
    """What Prometheus scraped is what the device printed, and both ends saw every session."""
    generated = sum(r["stats"]["generated_tokens"] for r in records)
    uplink = sum(r["stats"]["uplink_bytes"] for r in records)
    expected = {
        "sum(specdec_device_generated_tokens_total)": generated,
        "sum(specdec_device_uplink_bytes_total)": uplink,
        "sum(specdec_edge_uplink_bytes_total)": uplink,
        'sum(specdec_edge_sessions_ended_total{status="ok"})': NUM_SESSIONS,
        'sum(specdec_device_sessions_ended_total{status="ok"})': NUM_SESSIONS,
        "sum(specdec_edge_sessions_failed_total)": 0,
    }
    # The last session may have ended after the latest scrape: allow a few more scrapes.
    deadline = time.monotonic() + 10.0
    while (got := _scalars(prom, expected)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got == expected


def _scalars(prom: Prometheus, queries: dict[str, float]) -> dict[str, float]:
    out = {}
    for promql in queries:
        [series] = prom.query(promql)
        out[promql] = float(series["value"][1])
    return out
