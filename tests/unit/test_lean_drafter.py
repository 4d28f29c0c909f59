"""The default drafter's module (device/lean_drafter.py) on tiny random Llamas, loaded through the
same delta path (ModelSpec.delta -> builder) as the committed drafter, so these run anywhere.

- The float LeanDrafter with a full head is the transformers Llama: same logits
  (full forward, KV-cached token by token, and a token tree through a boolean mask).
- A reduced head gives q = 0 off the head and the full model's logits on it.
- q4_1_quantize / q4_1_dequantize round-trip Q4_1 weights exactly and any weight within half a step;
  Int4Linear computes with those weights within bfloat16 rounding.
- The int4 build stays a valid distribution over the head, close to the float build.
- apply_delta refuses what does not fit, and LeanDrafter refuses non-Llama configurations.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.common.sampling import model_probs
from specdec.common.modeling import DELTA_CONFIG, DELTA_WEIGHTS, CachedLM, ModelSpec, load_model
from specdec.device import lean_drafter
from specdec.testbed.tiny_models import make_model

VOCAB = 64
FLOAT_ATOL = 1e-4   # the same float32 math in another order (fused projections, cached attention)
IDS = [5, 9, 2, 33, 17, 8, 41, 12, 60, 3, 22, 7]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("lean") / "target", VOCAB, seed=11, hidden=32, layers=3)


def _delta(path: Path, keep: torch.Tensor, **meta) -> Path:
    lean_drafter.save_drafter(path, keep, {"name": "tiny", "num_layers": 3, **meta})
    return path


def _load(target_dir: Path, delta: Path):
    return load_model(ModelSpec(model=str(target_dir), delta=str(delta), builder=lean_drafter.DELTA_BUILDER))


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
    assert isinstance(lean.model, lean_drafter.LeanDrafter)
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


def _q4_1_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 file holds them: codes 0..15 (0 and 15 in every group, as ggml's rounding
    of each group's min and max gives), float16 steps and minima, dequantized in float32."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // lean_drafter.GROUP, lean_drafter.GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    step = (torch.rand(n, k // lean_drafter.GROUP, generator=g) * 0.02 + 1e-3).half().float()
    minimum = (-8 * step - torch.rand(n, k // lean_drafter.GROUP, generator=g) * 0.01).half().float()
    return lean_drafter.q4_1_dequantize(codes.reshape(n, k).int(), step, minimum)


def test_q4_1_round_trip_is_exact_on_q4_1_weights():
    w = _q4_1_weights(48, 96, seed=1)
    codes, step, minimum = lean_drafter.q4_1_quantize(w)
    assert int(codes.min()) == 0 and int(codes.max()) == lean_drafter.Q4_LEVELS
    assert torch.equal(lean_drafter.q4_1_dequantize(codes, step, minimum), w)


def test_q4_1_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    codes, step, minimum = lean_drafter.q4_1_quantize(w)
    err = (lean_drafter.q4_1_dequantize(codes, step, minimum) - w).abs().reshape(32, 2, lean_drafter.GROUP)
    # half a step, plus the float16 rounding of the step times the largest code
    bound = step / 2 + lean_drafter.Q4_LEVELS * step * 2.0 ** -11
    assert bool((err.amax(-1) <= bound * (1 + 1e-6)).all())
    assert float(err.max()) > 0  # random weights are not on the grid: the bound is what is tested
    assert lean_drafter.Int4Linear.from_float(w).exact_fraction < 0.1


def test_int4_linear_computes_with_the_q4_1_weights():
    w = _q4_1_weights(64, 96, seed=3)
    lin = lean_drafter.Int4Linear.from_float(w)
    assert lin.exact_fraction == 1.0
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    ref = x @ w.T
    # bfloat16 activations and output: ~2^-8 relative to the magnitudes summed
    tol = 2.0 ** -7 * (x.abs() @ w.abs().T)
    assert bool(((lin(x) - ref).abs() <= tol).all())
    with pytest.raises(ValueError, match="int4 needs"):
        lean_drafter.Int4Linear.from_float(torch.randn(24, 96))


@pytest.fixture(scope="module")
def q4_target_dir(target_dir, tmp_path_factory) -> Path:
    """The tiny target with its decoder-layer weights moved onto the Q4_1 grid, as the embedded
    target's are (it ships as a Q4_1 GGUF): the int4 drafter then holds exactly its weights."""
    m = load_model(ModelSpec(model=str(target_dir)))
    with torch.no_grad():
        for layer in m.model.model.layers:
            for lin in (*[getattr(layer.self_attn, f"{x}_proj") for x in "qkvo"],
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.copy_(lean_drafter.q4_1_dequantize(*lean_drafter.q4_1_quantize(lin.weight)))
    path = tmp_path_factory.mktemp("lean") / "q4_target"
    m.model.save_pretrained(path)
    m.tokenizer.save_pretrained(path)
    return path


def _head_tv(target_dir: Path, delta: Path, keep: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Per-position TV between the drafter's q and the float target's p restricted to the head."""
    ref_model = load_model(ModelSpec(model=str(target_dir)))
    with torch.inference_mode():
        ref = ref_model.model(input_ids=torch.tensor([IDS])).logits[0].float()             # [T, V]
    lean = _load(target_dir, delta)
    rows = _cached_rows(lean, IDS)
    q = model_probs(rows, 1.0)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    assert torch.isfinite(rows).all() and float(q[:, off].max()) == 0.0
    return 0.5 * (q[:, keep] - model_probs(ref[:, keep], 1.0)).abs().sum(-1), lean


def test_int4_build_on_q4_1_weights_is_the_target_up_to_bfloat16(q4_target_dir, tmp_path):
    keep = torch.arange(0, VOCAB, 2)
    tv, lean = _head_tv(q4_target_dir, _delta(tmp_path / "d", keep, int4=True), keep)
    assert isinstance(lean.model.layers[0].qkv, lean_drafter.Int4Linear)  # int4 really ran on CPU
    assert lean.model.int4_exact_fraction == 1.0
    # only bfloat16 rounding is left (measured mean TV 0.010, max 0.030); a wrong zero point, a mis-packed
    # tile or a mis-fused projection moves probabilities by ~0.5
    assert float(tv.mean()) < 0.02 and float(tv.max()) < 0.05, tv


def test_float16_head_is_the_float32_head_within_float16_rounding(target_dir, tmp_path):
    keep = torch.arange(0, VOCAB, 2)
    full = _load(target_dir, _delta(tmp_path / "f32", keep))
    half = _load(target_dir, _delta(tmp_path / "f16", keep, head_dtype="float16"))
    assert isinstance(half.model.head, lean_drafter.HalfHead) and half.model.head.weight.dtype == torch.float16
    ref, out = (CachedLM(m.model, m.device).forward(IDS, num_logits=len(IDS)) for m in (full, half))
    # float16 weights, activations and output: a few 2^-11 of the largest logit (measured max 0.004 of ~10)
    err = (out[:, keep] - ref[:, keep]).abs().max()
    assert 0 < err <= 2.0 ** -8 * ref[:, keep].abs().max()
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    assert float(model_probs(out, 1.0)[:, off].max()) == 0.0


def test_delta_refusals(target_dir, tmp_path):
    bad = _delta(tmp_path / "builder", torch.arange(VOCAB))
    meta = json.loads((bad / DELTA_CONFIG).read_text())
    (bad / DELTA_CONFIG).write_text(json.dumps({**meta, "builder": "os:system"}))
    with pytest.raises(ValueError, match="builder"):
        _load(target_dir, bad)
    named = _delta(tmp_path / "named", torch.arange(VOCAB))  # names the default builder, none passed in
    with pytest.raises(ValueError, match="names builder .* but none was passed in"):
        load_model(ModelSpec(model=str(target_dir), delta=str(named)))
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
        lean_drafter.LeanDrafter.from_hf(m.model, torch.arange(VOCAB))
