"""serving_attention: no cuDNN attention where the target serves on CUDA (docs/gpu.md: cuDNN's kernel
builds a plan for every new input shape, and a served forward's key length changes every round)."""
from __future__ import annotations

import torch

from specdec.common import modeling
from specdec.common.modeling import ModelSpec, load_model, serving_attention
from specdec.testbed import tiny_models


def test_cuda_turns_cudnn_attention_off_and_other_devices_leave_it() -> None:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        serving_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        serving_attention(torch.device("cuda"))  # the flag is process state: settable without a GPU
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_every_load_goes_through_it(tmp_path, monkeypatch) -> None:
    """load_model is the one path of the edge's and the device's models (the gpu-check's models call it
    on their own: bench/gpucheck/models.py)."""
    seen = []
    monkeypatch.setattr(modeling, "serving_attention", seen.append)
    load_model(ModelSpec(model=str(tiny_models.make_model(tmp_path / "m", 64, seed=1))))
    assert seen == [torch.device("cpu")]
