"""Packaging and layering rules, enforced on the source tree."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATH_MODULES = ["distributions", "lattice", "codecs", "verification", "tree", "treeplan", "conformal", "budget",
                "latency", "engine", "streams"]
MATH_ALLOWED = {"torch", "numpy", "math", "dataclasses", "enum", "struct", "typing", "collections",
                "functools", "itertools", "bisect", "__future__", "specdec", "abc", "operator", "hashlib"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("module", MATH_MODULES)
def test_math_modules_import_only_torch_numpy_and_stdlib(module) -> None:
    path = ROOT / "common" / f"{module}.py"
    if not path.exists():
        pytest.fail(f"math module {module} missing")
    extra = _roots(_imports(path)) - MATH_ALLOWED
    assert not extra, f"common/{module}.py imports {sorted(extra)}"
    spec = {n for n in _imports(path) if n.startswith("specdec.")}
    assert all(n.startswith("specdec.common.") for n in spec), spec


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in
                                        list((ROOT / "common").glob("*.py")) + list((ROOT / "device").glob("*.py")) +
                                        list((ROOT / "edge").glob("*.py"))))
def test_only_wire_servicer_and_client_touch_protobuf(path) -> None:
    names = _imports(ROOT / path)
    uses_pb = any("_pb2" in n or n.endswith(".pb") for n in names)
    allowed = {"common/wire.py", "edge/servicer.py", "edge/server.py", "device/client.py"}
    if uses_pb:
        assert path in allowed, f"{path} imports generated protobuf code"


@pytest.mark.parametrize("path", ["device/drafter.py", "edge/verifier.py", "common/modeling.py"])
def test_model_code_never_imports_grpc(path) -> None:
    assert "grpc" not in _roots(_imports(ROOT / path))


@pytest.mark.parametrize("path", ["edge/servicer.py", "device/client.py", "common/wire.py", "edge/server.py"])
def test_transport_code_never_imports_transformers(path) -> None:
    assert "transformers" not in _roots(_imports(ROOT / path))


def test_installed_under_one_namespace() -> None:
    for name in ("specdec.common", "specdec.device", "specdec.edge", "specdec.common.pb.speculative_pb2"):
        importlib.import_module(name)
    assert importlib.util.find_spec("common") is None or "site-packages" not in str(
        importlib.util.find_spec("common").origin or "")


def test_generated_protobuf_is_not_committed() -> None:
    ignore = (ROOT / ".gitignore").read_text()
    assert "common/pb/*_pb2.py" in ignore and "common/pb/*_pb2_grpc.py" in ignore


def test_proto_package_is_versioned() -> None:
    text = (ROOT / "proto" / "specdec" / "v1" / "speculative.proto").read_text()
    assert "package specdec.v1;" in text
