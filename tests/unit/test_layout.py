"""Packaging and layering rules, enforced on the source tree."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"common": "specdec.common", "device": "specdec.device", "edge": "specdec.edge"}  # pyproject's package-dir
TOOLS = {"bench": "specdec.bench", "testbed": "specdec.testbed", "drafter_build": "specdec.drafter_build"}
# Pure math (no I/O, no model, no clock): common/'s shared math, and each side's own.
MATH_MODULES = [*(f"common/{m}" for m in ("distributions", "lattice", "codecs", "verification", "tree", "treeplan",
                                          "sampling", "settings", "modes", "stats", "streams", "validation",
                                          "idpack")),
                *(f"device/{m}" for m in ("conformal", "budget", "latency", "autotune", "safety_net",
                                          "tracker_state", "verify_fit", "q_measure")),
                "edge/verify_batch"]
MATH_ALLOWED = {"torch", "numpy", "math", "dataclasses", "enum", "struct", "typing", "collections",
                "functools", "itertools", "bisect", "__future__", "specdec", "abc", "operator", "hashlib"}


def _package(path: Path) -> str:
    """The installed package a source file belongs to: common/pb/x.py -> specdec.common.pb."""
    top, *sub = path.relative_to(ROOT).parent.parts
    return ".".join([{**PACKAGES, **TOOLS}[top], *sub])


def _imports(path: Path, package: str | None = None, members: bool = False) -> set[str]:
    """Absolute names of the modules ``path`` imports, relative imports resolved against its
    package (``from . import x`` -> package.x, ``from .pb import y`` -> package.pb); with ``members``
    also what an absolute ``from m import x`` names (m.x: a module or a name in m)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if members)
        elif isinstance(node, ast.ImportFrom):
            parts = (package or _package(path)).split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            names.update([f"{base}.{node.module}"] if node.module else (f"{base}.{a.name}" for a in node.names))
    return names


def test_relative_imports_are_resolved(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from . import wire, lattice\nfrom .pb import speculative_pb2\nfrom ..edge import server\n"
                   "import torch\n")
    assert _imports(src, "specdec.common") == {"specdec.common.wire", "specdec.common.lattice",
                                               "specdec.common.pb", "specdec.edge", "torch"}
    assert _package(ROOT / "common" / "pb" / "speculative_pb2.py") == "specdec.common.pb"


def _roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("module", MATH_MODULES)
def test_math_modules_import_only_torch_numpy_and_stdlib(module) -> None:
    path = ROOT / f"{module}.py"
    if not path.exists():
        pytest.fail(f"math module {module} missing")
    extra = _roots(_imports(path)) - MATH_ALLOWED
    assert not extra, f"{module}.py imports {sorted(extra)}"
    side = PACKAGES[module.split("/")[0]]
    spec = {n for n in _imports(path) if n.startswith("specdec.")}
    assert all(n.startswith(("specdec.common.", f"{side}.")) or n == side for n in spec), spec


def _package_deps(top: str) -> dict[str, set[str]]:
    """{module of ``top`` (e.g. "common"): the specdec modules it imports, as "side.module"}."""
    out = {}
    for path in sorted((ROOT / top).glob("*.py")):
        names = [n.split(".") for n in _imports(path, members=True) if n.startswith("specdec.")]
        out[path.stem] = {f"{parts[1]}.{parts[2]}" for parts in names if len(parts) > 2}
    return out


def test_sides_import_common_and_never_each_other() -> None:
    """common/ imports neither side; the device never imports the edge's code, nor the edge the
    device's: what both need lives in common/."""
    for top, banned in (("common", ("device.", "edge.")), ("device", ("edge.",)), ("edge", ("device.",))):
        bad = {m: sorted(d for d in deps if d.startswith(banned)) for m, deps in _package_deps(top).items()}
        assert not {m: d for m, d in bad.items() if d}, f"{top}/ imports across sides: {bad}"


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` ({module: modules it imports}) as a path that returns to its
    start, or None (depth-first search: a module met again while still on the path closes a cycle)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for dep in sorted(graph.get(module, ())):
            cycle = visit(dep, path + [module])
            if cycle:
                return cycle
        done.add(module)
        return None
    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("top", list(PACKAGES))
def test_no_import_cycle_within_a_package(top) -> None:
    """A module that imports a module importing it back (even under TYPE_CHECKING or inside a
    function) has two halves of one thing: the round kinds take the session's narrow interface
    (device/drafting.py) instead of importing the session that imports them."""
    graph = {m: {d.split(".")[1] for d in deps if d.startswith(f"{top}.")} - {m}
             for m, deps in _package_deps(top).items()}
    assert _a_cycle(graph) is None, f"{top}/ import cycle: {' -> '.join(_a_cycle(graph))}"


MAX_CLASS_METHODS, MAX_CLASS_LINES = 20, 300  # beyond these a class holds more than one thing


def test_no_product_class_holds_more_than_one_thing() -> None:
    """The objects every feature reaches into stay small: a session, a tracker or a scheduler that
    grows past these limits gets its parts out (device/parts.py, link_fit.py, batching.Arrivals)."""
    big = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                    lines = node.end_lineno - node.lineno + 1
                    if methods > MAX_CLASS_METHODS or lines > MAX_CLASS_LINES:
                        big.append(f"{top}/{path.name} {node.name}: {methods} methods, {lines} lines")
    assert not big, big


def test_common_holds_only_what_both_sides_use() -> None:
    """Every module of common/ is reached by the device's code and by the edge's (directly or through
    other common modules); side-only code lives on its side."""
    common = _package_deps("common")

    def reached(top: str) -> set[str]:
        seen: set[str] = set()
        todo = [d.split(".")[1] for deps in _package_deps(top).values() for d in deps if d.startswith("common.")]
        while todo:
            module = todo.pop()
            if module in common and module not in seen:
                seen.add(module)
                todo.extend(d.split(".")[1] for d in common[module] if d.startswith("common."))
        return seen

    one_sided = set(common) - {"__init__"} - (reached("device") & reached("edge"))
    assert not one_sided, f"common/ modules only one side uses: {sorted(one_sided)}"


SOURCES = sorted(str(p.relative_to(ROOT)) for top in PACKAGES for p in (ROOT / top).glob("*.py"))


@pytest.mark.parametrize("path", SOURCES)
def test_only_wire_servicer_and_client_touch_protobuf(path) -> None:
    names = _imports(ROOT / path)
    uses_pb = any("_pb2" in n or n.endswith(".pb") for n in names)
    allowed = {"common/wire.py", "edge/servicer.py", "edge/server.py", "device/client.py"}
    if uses_pb:
        assert path in allowed, f"{path} imports generated protobuf code"


@pytest.mark.parametrize("path", SOURCES)
def test_no_import_by_name(path) -> None:
    """A module imported from a string (importlib.import_module, __import__) is a dependency these
    tests cannot see: callers pass the code in instead (ModelSpec.builder)."""
    calls = [ast.unparse(node.func) for node in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")]
    assert not calls, f"{path} imports by name: {calls}"


@pytest.mark.parametrize("path", ["device/session.py", "edge/verifier.py", "edge/registry.py", "common/modeling.py"])
def test_model_code_never_imports_grpc(path) -> None:
    assert "grpc" not in _roots(_imports(ROOT / path))


@pytest.mark.parametrize("path", ["edge/servicer.py", "device/client.py", "device/grpc_status.py", "common/wire.py",
                                  "edge/server.py"])
def test_transport_code_never_imports_transformers(path) -> None:
    assert "transformers" not in _roots(_imports(ROOT / path))


def test_installed_under_one_namespace(tmp_path) -> None:
    for name in ("specdec.common", "specdec.device", "specdec.edge", "specdec.common.pb.speculative_pb2",
                 *TOOLS.values()):
        importlib.import_module(name)
    # Outside the checkout (cwd elsewhere, no PYTHONPATH) the install provides specdec.* and nothing
    # else: a top-level ``common`` or ``bench`` there means the source folders leaked onto sys.path.
    names = [*PACKAGES, *TOOLS, "tests", "specdec.common", "specdec.bench"]
    code = ("import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) is not None "
            f"for n in {names!r}}}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    found = json.loads(out.stdout)
    assert found == {n: n.startswith("specdec.") for n in names}, found


def _python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split() if (ROOT / p).is_file()]


def _edits_sys_path(node: ast.AST) -> bool:
    """``sys.path.insert(...)``, ``sys.path.append(...)``, ``sys.path[:0] = ...``, ``sys.path = ...``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return ast.unparse(node.func.value) == "sys.path" and node.func.attr in ("insert", "append", "extend")
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(ast.unparse(t).startswith("sys.path") for t in targets)
    return False


def test_nothing_edits_sys_path() -> None:
    """Product, tools and tests import each other as installed packages (specdec.*, tests.*)."""
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _python_files()
             for node in ast.walk(ast.parse(path.read_text())) if _edits_sys_path(node)]
    assert not edits, edits


def test_product_never_imports_its_tools_or_tests_and_tools_never_import_tests() -> None:
    tools = tuple(f"{name}." for name in TOOLS.values())
    for path in _python_files():
        top = path.relative_to(ROOT).parts[0]
        if top not in PACKAGES and top not in TOOLS:
            continue
        names = _imports(path)
        assert not [n for n in names if n == "tests" or n.startswith("tests.")], f"{path} imports a test helper"
        if top in PACKAGES:
            assert not [n for n in names if n.startswith(tools)], f"{path} imports a tool"


def test_generated_protobuf_is_not_committed() -> None:
    ignore = (ROOT / ".gitignore").read_text()
    assert "common/pb/*_pb2.py" in ignore and "common/pb/*_pb2_grpc.py" in ignore


def test_proto_package_is_versioned() -> None:
    text = (ROOT / "proto" / "specdec" / "v1" / "speculative.proto").read_text()
    assert "package specdec.v1;" in text


def test_the_modules_run_first_exist() -> None:
    """tests/conftest.py's HEAVY_FIRST names modules by path: a renamed one would silently fall back to
    the end of the run, where a long module keeps one worker busy alone."""
    from tests.conftest import HEAVY_FIRST
    missing = [module for module in HEAVY_FIRST if not (ROOT / module).is_file()]
    assert not missing and len(set(HEAVY_FIRST)) == len(HEAVY_FIRST), missing
