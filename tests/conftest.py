"""Shared fixtures: tiny real checkpoints on disk, loaded through the product's loading code."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # test helper modules (tiny_models, unit/toy_models) by name
    sys.path.insert(0, str(TESTS_DIR))

# Tiny models are dominated by thread hand-off: one intra-op thread is ~20x faster on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair_v8(tmp_path_factory) -> tuple[Path, Path]:
    """Target and drafter with an 8-token vocabulary (statistical tests)."""
    return tiny_models.make_pair(tmp_path_factory.mktemp("tiny8"), 8)


@pytest.fixture(scope="session")
def tiny_pair_v512(tmp_path_factory) -> tuple[Path, Path]:
    """Target and drafter with a 512-token vocabulary (greedy identity, byte accounting)."""
    return tiny_models.make_pair(tmp_path_factory.mktemp("tiny512"), 512, logit_scale=2.0)
