"""Build step that pyproject.toml cannot express: generate the protobuf code into the package.

Everything else (metadata, packages, package data) lives in pyproject.toml. A wheel built from a
clean clone (`pip wheel .`, `pip install .`, `pip install git+URL`) then contains
specdec/common/pb/speculative_pb2{,_grpc}.py and .pyi; an editable install generates them in
common/pb, where `make proto` puts them.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PB_PACKAGE = "specdec.common.pb"


def _codegen():
    """proto/codegen.py, loaded by path: the package being built is not importable yet."""
    spec = importlib.util.spec_from_file_location("specdec_codegen", ROOT / "proto" / "codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProto(build_py):
    """build_py that also generates the protobuf code into the package it builds."""

    def run(self) -> None:
        super().run()
        # A regular build packs build_lib into the wheel; an editable install imports straight from
        # the source tree (common/pb, where `make proto` writes too).
        source = ROOT / self.get_package_dir(PB_PACKAGE)
        out = source if self.editable_mode else Path(self.build_lib, *PB_PACKAGE.split("."))
        codegen = _codegen()
        try:
            paths = codegen.generate(out)
        except ImportError:
            paths = _carried(codegen, source, out)
        for path in paths:
            self.announce(f"generated {path}", level=2)


def _carried(codegen, source: Path, out: Path) -> list[Path]:
    """Without grpcio-tools (a machine that can fetch nothing, e.g. a lent GPU machine: docs/gpu.md),
    the code generated elsewhere and carried in common/pb, if it is there."""
    found = [source / name for name in codegen.GENERATED]
    if not all(path.is_file() for path in found):
        raise ImportError("generating the protobuf code needs grpcio-tools (or the generated files in "
                          f"{source}: `make proto` where it is installed)")
    out.mkdir(parents=True, exist_ok=True)
    if out != source:
        for path in found:
            shutil.copy2(path, out / path.name)
    return [out / path.name for path in found]


setup(cmdclass={"build_py": BuildPyWithProto})
