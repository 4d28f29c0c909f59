"""The `gpu` tier: the edge's real paths on a CUDA device (``make test-gpu``, and `make gpu-check` on a
lent GPU machine). Every test here is marked ``gpu``: the default suite deselects them, and where no
CUDA device exists they skip, saying so.

``SPECDEC_GPU_TEST_DEVICE=cpu`` runs the same tests on the CPU instead: how they are checked on a
machine without a GPU (the tests themselves, not CUDA).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specdec.testbed import tiny_models

DEVICE = os.environ.get("SPECDEC_GPU_TEST_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if DEVICE.startswith("cuda") and not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="no CUDA device here: the gpu tier needs one "
                                                        "(SPECDEC_GPU_TEST_DEVICE=cpu runs it on the CPU)"))


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def close_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A 512-token target and a drafter close to it: most drafts are accepted at T = 0, so the accept,
    rollback and bonus paths all run."""
    root = tmp_path_factory.mktemp("gpu512")
    target = tiny_models.make_model(root / "target", 512, seed=1, hidden=64, logit_scale=8.0)
    return target, tiny_models.make_close_drafter(target, root / "drafter", noise=0.05)


@pytest.fixture(scope="session")
def margin_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The same for bfloat16: a target whose greedy choices are never near ties
    (tiny_models.make_margin_model), so a batched forward's rounding cannot flip one."""
    root = tmp_path_factory.mktemp("gpu512m")
    target = tiny_models.make_margin_model(root / "target", 512, seed=1)
    return target, tiny_models.make_close_drafter(target, root / "drafter", noise=0.05)
