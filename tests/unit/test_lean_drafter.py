"""The default drafter's module (device/default_drafter.py) on tiny random Llamas, loaded through the
same delta path (ModelSpec.delta -> builder) as the committed drafter, so these run anywhere.

- The float LeanDrafter with a full head and no smoothing is the transformers Llama: same logits
  (full forward, KV-cached token by token, and a token tree through a boolean mask).
- SmoothQuant folding is exact in float (it only re-associates products).
- A reduced head gives q = 0 off the head and the full model's logits on it.
- The int8 build stays a valid distribution over the head, close to the float build.
- apply_delta refuses what does not fit, and LeanDrafter refuses non-Llama configurations.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.common.engine import model_probs
from specdec.common.modeling import DELTA_CONFIG, DELTA_WEIGHTS, CachedLM, ModelSpec, load_model
from specdec.device import default_drafter as D
from tiny_models import make_model

VOCAB = 64
FLOAT_ATOL = 1e-4   # the same float32 math in another order (fused projections, cached attention)
IDS = [5, 9, 2, 33, 17, 8, 41, 12, 60, 3, 22, 7]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("lean") / "target", VOCAB, seed=11, hidden=32, layers=3)


def _delta(path: Path, keep: torch.Tensor, scales: dict | None = None, **meta) -> Path:
    D.save_drafter(path, keep, scales or {}, {"name": "tiny", "num_layers": 3, **meta})
    return path


def _load(target_dir: Path, delta: Path):
    return load_model(ModelSpec(model=str(target_dir), delta=str(delta)))


def _cached_rows(model, ids: list[int], prefix: int = 4) -> torch.Tensor:
    lm = CachedLM(model.model, model.device)
    rows = [lm.forward(ids[:prefix], num_logits=prefix)]
    rows += [lm.forward([t], num_logits=1) for t in ids[prefix:]]
    return torch.cat(rows)                                                             # [T, V]


@pytest.fixture(scope="module")
def reference(target_dir):
    m = load_model(ModelSpec(model=str(target_dir)))
    with torch.inference_mode():
        return m, m.model(input_ids=torch.tensor([IDS])).logits[0].float()             # [T, V]


def test_float_full_head_equals_transformers(target_dir, reference, tmp_path):
    ref_model, ref = reference
    lean = _load(target_dir, _delta(tmp_path / "d", torch.arange(VOCAB)))
    assert isinstance(lean.model, D.LeanDrafter)
    full = CachedLM(lean.model, lean.device).forward(IDS, num_logits=len(IDS))
    assert torch.allclose(full, ref, atol=FLOAT_ATOL, rtol=0)
    assert torch.allclose(_cached_rows(lean, IDS), ref, atol=FLOAT_ATOL, rtol=0)


def test_tree_mask_equals_transformers(target_dir, reference, tmp_path):
    """Two branches after a shared prefix, in one masked call, as the device drafts token trees."""
    ref_model, _ = reference
    lean = _load(target_dir, _delta(tmp_path / "d", torch.arange(VOCAB)))
    prefix, branch_a, branch_b = IDS[:5], [7, 8], [9]
    nodes = branch_a + branch_b
    attend = torch.ones(len(nodes), len(prefix) + len(nodes), dtype=torch.bool)
    attend[:, len(prefix):] = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([5, 6, 5])
    outs = []
    for m in (lean, ref_model):
        lm = CachedLM(m.model, m.device)
        lm.forward(prefix, num_logits=1)
        outs.append(lm.forward_masked(nodes, attend, positions, num_logits=len(nodes)))
    assert torch.allclose(outs[0], outs[1], atol=FLOAT_ATOL, rtol=0)


def test_smoothing_is_exact_in_float(target_dir, reference, tmp_path):
    _, ref = reference
    plain = _load(target_dir, _delta(tmp_path / "plain", torch.arange(VOCAB)))
    act_max = D.calibrate(plain.model, [IDS])
    scales = D.smoothing_scales(act_max, plain.model)
    assert set(scales) == {f"{i}.{k}" for i in range(3) for k in D.SMOOTH_KEYS} | {"head"}
    assert any(float((s - 1).abs().max()) > 0.1 for s in scales.values())   # the test moves weights
    smoothed = _load(target_dir, _delta(tmp_path / "smooth", torch.arange(VOCAB), scales))
    out = CachedLM(smoothed.model, smoothed.device).forward(IDS, num_logits=len(IDS))
    # scales travel as float16: folding s and 1/s of the same stored value is still exact
    assert torch.allclose(out, ref, atol=10 * FLOAT_ATOL, rtol=0)


def test_reduced_head_is_the_full_model_on_the_head(target_dir, reference, tmp_path):
    _, ref = reference
    keep = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 55])
    lean = _load(target_dir, _delta(tmp_path / "d", keep))
    out = CachedLM(lean.model, lean.device).forward(IDS, num_logits=len(IDS))
    assert torch.allclose(out[:, keep], ref[:, keep], atol=FLOAT_ATOL, rtol=0)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    for temperature in (0.0, 0.7, 1.0):
        q = model_probs(out, temperature)
        assert float(q[:, off].max()) == 0.0
        assert torch.allclose(q.sum(-1), torch.ones(len(IDS), dtype=q.dtype))


def test_int8_build_is_a_close_valid_distribution(target_dir, reference, tmp_path):
    _, ref = reference
    keep = torch.arange(0, VOCAB, 2)
    lean = _load(target_dir, _delta(tmp_path / "d", keep, int8=True))
    assert "quantized" in type(lean.model.layers[0].qkv.inner).__module__  # int8 really ran on CPU
    rows = _cached_rows(lean, IDS)
    q = model_probs(rows, 1.0)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    assert torch.isfinite(rows).all() and float(q[:, off].max()) == 0.0
    p_on_head = model_probs(ref[:, keep], 1.0)
    tv = 0.5 * (q[:, keep] - p_on_head).abs().sum(-1)
    # int8 rounding moves probabilities a little (measured mean 0.06 on this 32-wide model); a wrong
    # scale or a mis-fused projection moves them by ~0.5
    assert float(tv.mean()) < 0.12 and float(tv.max()) < 0.3, tv


def test_delta_refusals(target_dir, tmp_path):
    bad = _delta(tmp_path / "builder", torch.arange(VOCAB))
    meta = json.loads((bad / DELTA_CONFIG).read_text())
    (bad / DELTA_CONFIG).write_text(json.dumps({**meta, "builder": "os:system"}))
    with pytest.raises(ValueError, match="builder"):
        _load(target_dir, bad)
    out_of_vocab = _delta(tmp_path / "ids", torch.tensor([0, VOCAB]))
    with pytest.raises(ValueError, match="vocabulary"):
        _load(target_dir, out_of_vocab)
    from safetensors.torch import save_file
    wrong = tmp_path / "shape"
    wrong.mkdir()
    save_file({"model.norm.weight": torch.ones(7)}, str(wrong / DELTA_WEIGHTS))
    (wrong / DELTA_CONFIG).write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="does not fit"):
        _load(target_dir, wrong)


def test_lean_drafter_refuses_other_architectures(target_dir):
    m = load_model(ModelSpec(model=str(target_dir)))
    m.model.config.mlp_bias = True
    with pytest.raises(ValueError, match="mlp_bias"):
        D.LeanDrafter(m.model, torch.arange(VOCAB))
