"""deploy/ as shipped (issue 34): every Kubernetes manifest passes a real validator
(kubernetes-validate, strict, against the schemas of its latest Kubernetes version), both HAProxy
configurations pass ``haproxy -c`` (the one in the ConfigMap with test certificates at its paths), and
the manifests agree with the code: the edge's arguments parse with edge-server's own parser, its
probes are the edge's probe endpoints, the PodDisruptionBudget and the proxy select the edge pods.
The committed deploy/haproxy/haproxy.cfg itself runs in test_fleet_proxy.py."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from specdec.common.protocol import SESSION_KEY
from specdec.edge import __main__ as edge_cli
from specdec.edge.http import probe_app
from tests.support.certs import TestCA
from tests.support.harness import ROOT

K8S = ROOT / "deploy" / "k8s"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _kind(kind: str, name: str) -> dict:
    return next(d for _, d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("name, doc", _documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_manifest_validates_strictly(name, doc) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_control_the_validator_rejects_a_misspelt_field() -> None:
    doc = _kind("Deployment", "specdec-edge")
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"] = {"httpGet": {"pth": "/readyz", "port": "metrics"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_edge_pods_args_are_edge_server_flags_and_probes_its_endpoints() -> None:
    edge = _kind("Deployment", "specdec-edge")["spec"]["template"]["spec"]
    [container] = edge["containers"]
    assert container["args"][0] == "edge-server"
    args = [a.replace("$(POD_NAME)", "specdec-edge-0") for a in container["args"][1:]]
    cfg = edge_cli.config_from_args(edge_cli.build_parser().parse_args(args))
    assert cfg.name == "specdec-edge-0" and cfg.metrics_port == 9100
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == cfg.metrics_port and ports["grpc"] == cfg.port
    routes = {r.resource.canonical for r in probe_app(None, lambda: (True, "")).router.routes()}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for probe in ("livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] in routes
    # The kubelet's SIGKILL must not cut the drain short: preStop + drain + moving + the gRPC grace.
    assert edge["terminationGracePeriodSeconds"] > 5 + cfg.drain_timeout_s + 2 + 5


def test_the_disruption_budget_and_the_proxy_cover_the_edge_pods() -> None:
    pods = _kind("Deployment", "specdec-edge")["spec"]["template"]["metadata"]["labels"]
    budget = _kind("PodDisruptionBudget", "specdec-edge")["spec"]
    assert budget["selector"]["matchLabels"].items() <= pods.items() and budget["maxUnavailable"] == 1
    headless = _kind("Service", "specdec-edge-pods")["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"].items() <= pods.items()
    config = _kind("ConfigMap", "specdec-proxy")["data"]["haproxy.cfg"]
    assert "specdec-edge-pods.default.svc.cluster.local:50051" in config
    assert f"stick on req.hdr({SESSION_KEY})" in config


def _check(config: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    assert os.path.exists(HAPROXY), "haproxy is not installed: run .ci/system-deps.sh"
    return subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_the_hosts_haproxy_config_is_valid() -> None:
    env = {"SPECDEC_PROXY_BIND": "127.0.0.1:50050"}
    for i in (1, 2, 3):
        env |= {f"SPECDEC_EDGE{i}": f"127.0.0.1:{50050 + i}", f"SPECDEC_EDGE{i}_PROBE": str(9100 + i)}
    result = _check(ROOT / "deploy" / "haproxy" / "haproxy.cfg", env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_kubernetes_haproxy_config_is_valid(tmp_path) -> None:
    """The ConfigMap's file, its certificate paths pointed at certificates made here."""
    ca = TestCA(tmp_path)
    server = ca.issue("specdec-edge", server=True)
    tls = tmp_path / "tls"
    tls.mkdir()
    shutil.copy(server.cert, tls / "tls.crt")
    shutil.copy(server.key, tls / "tls.crt.key")  # the volume's items name the key so
    shutil.copy(ca.pem.cert, tls / "ca.crt")
    config = _kind("ConfigMap", "specdec-proxy")["data"]["haproxy.cfg"].replace("/etc/haproxy/tls", str(tls))
    (tmp_path / "haproxy.cfg").write_text(config)
    result = _check(tmp_path / "haproxy.cfg")
    assert result.returncode == 0, result.stdout + result.stderr
