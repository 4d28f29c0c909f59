"""The standard Python install from a clean clone: wheel, fresh virtual environment, both commands.

A copy of the repository's git-tracked files (no generated protobuf code, no build outputs) is built
into a wheel with pip, the wheel is installed into a new virtual environment, and `edge-server` and
`device-client` run from that environment's bin/ in a directory outside the checkout, on tiny models.

Two shortcuts keep this offline and fast, and what they skip is checked separately:
- the wheel is built with ``--no-build-isolation``, i.e. with this venv's setuptools and grpcio-tools
  instead of a freshly downloaded set; test_build_requirements_match_the_test_venv checks that the
  build-system's grpcio-tools pin is the one this venv has, so the same protoc runs;
- the wheel is installed with ``--no-deps``, and only afterwards a .pth line puts this venv's
  site-packages behind the new environment's own (torch, transformers, grpc are not downloaded
  again). A plain path line does not run this venv's editable-install hook, so ``specdec`` resolves
  to the installed wheel, which the test checks.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.support.harness import VENV_BIN, EdgeProcess, load, target_greedy
from specdec.common.modeling import encode_prompt

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("speculative_pb2.py", "speculative_pb2.pyi", "speculative_pb2_grpc.py")
PROMPT = "w5 w6 w7"
MAX_NEW = 8


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot tell tracked files from build outputs")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split("\0") if p and (ROOT / p).is_file()]  # working tree, minus deletions


def _clean_copy(dest: Path) -> Path:
    for rel in _tracked_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    assert not list(dest.rglob("*_pb2*")), "generated protobuf code is tracked by git"
    return dest


def _build_and_install(src: Path, work: Path) -> Path:
    """Wheel from ``src``, installed into a new venv under ``work``; returns that venv's root."""
    dist, env = work / "dist", work / "venv"
    subprocess.run([str(VENV_BIN / "pip"), "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True, cwd=work)
    (wheel,) = dist.glob("specdec-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run([str(VENV_BIN / "pip"), "--python", str(env / "bin" / "python"), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True, cwd=work)
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_specdec_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    return _build_and_install(_clean_copy(work / "src"), work)


def test_build_requirements_match_the_test_venv() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (tools,) = [r for r in meta["build-system"]["requires"] if r.startswith("grpcio-tools")]
    assert tools in meta["project"]["optional-dependencies"]["test"]


def test_wheel_has_generated_code_and_default_drafter(installed, tmp_path) -> None:
    probe = ("import json, specdec.common.pb.speculative_pb2_grpc as g, specdec.device.lean_drafter as d; "
             "print(json.dumps([g.__file__, d.has_default_drafter()]))")
    out = subprocess.run([str(installed / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         cwd=tmp_path, check=True)
    grpc_file, has_drafter = json.loads(out.stdout)
    pb_dir = Path(grpc_file).parent
    assert pb_dir.is_relative_to(installed), grpc_file  # the wheel's copy, not the checkout's
    assert all((pb_dir / name).is_file() for name in GENERATED)
    assert "from . import speculative_pb2" in (pb_dir / "speculative_pb2_grpc.py").read_text()
    weights = [p for p in _tracked_files() if p.startswith("device/drafter_weights/")]
    assert weights
    for rel in weights:
        installed_file = pb_dir.parents[1] / rel  # site-packages/specdec/<rel>
        assert installed_file.read_bytes() == (ROOT / rel).read_bytes(), rel
    assert has_drafter


def test_installed_commands_run_outside_the_checkout(installed, tiny_pair_v512, tmp_path) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    bindir = installed / "bin"
    edge = EdgeProcess("--model", str(target_dir), "--threads", "1", bindir=bindir, cwd=tmp_path)
    try:
        r = subprocess.run([str(bindir / "device-client"), "--edge", edge.address, "--draft-model", str(drafter_dir),
                            "--prompt", PROMPT, "--raw", "--max-new-tokens", str(MAX_NEW), "--temperature", "0",
                            "--threads", "1", "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        assert edge.stop() == 0
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    tok = load(str(drafter_dir)).tokenizer
    assert record["token_ids"] == target_greedy(target_dir, encode_prompt(tok, PROMPT, raw=True), MAX_NEW)
