"""Shared fixtures: tiny real checkpoints on disk, loaded through the product's loading code."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
for _helpers in (TESTS_DIR, TESTS_DIR / "integration"):  # helper modules (tiny_models, harness) by name
    if str(_helpers) not in sys.path:
        sys.path.insert(0, str(_helpers))

# Tiny models are dominated by thread hand-off: one intra-op thread is ~20x faster on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair_v8(tmp_path_factory) -> tuple[Path, Path]:
    """Target and a close drafter with an 8-token vocabulary (statistical tests)."""
    root = tmp_path_factory.mktemp("tiny8")
    target = tiny_models.make_model(root / "target-v8", 8, seed=1)
    return target, tiny_models.make_close_drafter(target, root / "draft-v8", noise=0.3)


@pytest.fixture(scope="session")
def tiny_pair_v512(tmp_path_factory) -> tuple[Path, Path]:
    """Target and drafter with a 512-token vocabulary (greedy identity, byte accounting)."""
    return tiny_models.make_pair(tmp_path_factory.mktemp("tiny512"), 512, logit_scale=2.0)
