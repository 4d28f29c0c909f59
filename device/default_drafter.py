"""The default drafter for the embedded target (SmolLM2-135M-Instruct): a few distilled layers.

Architecture: the target's token embeddings (shared, taken from the target checkpoint at load time),
``num_layers`` decoder layers of the target's shape trained by KL distillation to the target, the
final norm, and a reduced LM head over the ``N`` tokens the target emits most (q = 0 elsewhere, so
the device can only draft tokens in the head; the system stays lossless). The linear layers run in
int8 (dynamic activation scales) on CPU, where a drafter this small is bound by reading weights.

Only what differs from the target is committed (``drafter_weights/``: the layers, the norm, the head
rows and their token ids); :func:`default_drafter_spec` loads the truncated target through
:func:`specdec.common.modeling.load_model` and lays those weights over it (``ModelSpec.delta``), so
the drafter shares the target's tokenizer and loading code exactly. How the weights were made and
what they measure: ``drafter_weights/README.md``; the recipe: ``make drafter`` (``drafter/``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.common.modeling import DELTA_CONFIG, DELTA_WEIGHTS, HEAD_KEEP_IDS, ModelSpec

WEIGHTS_DIR = Path(__file__).resolve().parent / "drafter_weights"
STORED_DTYPE = torch.float16  # halves the committed size; the drafter computes in float32 / int8


def has_default_drafter(path: Path = WEIGHTS_DIR) -> bool:
    return (path / DELTA_CONFIG).is_file() and (path / DELTA_WEIGHTS).is_file()


def drafter_meta(path: Path = WEIGHTS_DIR) -> dict:
    """The delta's ``delta.json``: name, num_layers, head_size, int8, draft_len and what it measured."""
    return json.loads((path / DELTA_CONFIG).read_text())


def default_drafter_spec(device: str = "cpu", dtype: str = "float32", path: Path = WEIGHTS_DIR) -> ModelSpec:
    """The ModelSpec that loads the default drafter: the target cut to the drafter's depth + delta."""
    return ModelSpec(device=device, dtype=dtype, num_layers=int(drafter_meta(path)["num_layers"]),
                     delta=str(path))


def save_drafter(path: Path, layers: torch.nn.ModuleList, norm: torch.nn.Module, head_weight: torch.Tensor,
                 keep_ids: torch.Tensor, meta: dict) -> None:
    """Write the delta: ``model.layers.{i}.*``, ``model.norm.weight``, the head rows [N, H] and ids [N]."""
    from safetensors.torch import save_file

    tensors = {}
    for i, layer in enumerate(layers):
        for name, value in layer.state_dict().items():
            tensors[f"model.layers.{i}.{name}"] = value.detach().to(STORED_DTYPE).contiguous()
    tensors["model.norm.weight"] = norm.weight.detach().to(STORED_DTYPE).contiguous()
    tensors["lm_head.weight"] = head_weight.detach().to(STORED_DTYPE).contiguous()
    tensors[HEAD_KEEP_IDS] = keep_ids.to(torch.int64).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / DELTA_WEIGHTS))
    (path / DELTA_CONFIG).write_text(json.dumps({**meta, "num_layers": len(layers),
                                                 "head_size": int(keep_ids.numel())}, indent=2) + "\n")
