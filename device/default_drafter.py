"""The default drafter for the embedded target (SmolLM2-135M-Instruct).

What it is: the target itself, run the way a CPU device runs it fast. Every linear layer holds int8
weights (fbgemm dynamic quantization: activations quantized per call, int8 x int8 products), so a
decode step reads ~4x fewer bytes; activation outliers, which per-tensor int8 handles badly, are
first moved into the weights by SmoothQuant scales (Xiao et al. 2022, arXiv 2211.10438) folded
exactly into the preceding norm / projection weights. The LM head covers only the ``N`` tokens the
target emits most (q = 0 elsewhere: the device never drafts a token outside the head, and the edge
verifies against exactly that q, so the system stays lossless). A plain KV-cached forward replaces
the transformers module stack, whose per-layer Python overhead would cost as much as the int8
matmuls.

What is committed (``drafter_weights/``, only what differs from the target): the head's token ids
and the smoothing scales, plus ``delta.json``. The weights themselves are the target's, read at load
time through :func:`specdec.common.modeling.load_model` (``ModelSpec.delta`` -> this module's
:func:`build`), so drafter and target share their tokenizer and loading code exactly. How the files
were made and what the drafter measures: ``drafter_weights/README.md``; the recipe: ``make drafter``.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.common.modeling import DELTA_CONFIG, DELTA_WEIGHTS, ModelSpec

WEIGHTS_DIR = Path(__file__).resolve().parent / "drafter_weights"
BUILDER = "specdec.device.default_drafter:build"
HEAD_IDS = "head.keep_ids"          # [N] int64: vocabulary ids the head covers, sorted
# Logit of the tokens the head leaves out: finite (the codecs refuse inf), and exp() of it minus any
# real logit is exactly 0 in float32 at every temperature <= 1e4, so q = 0 there.
OUT_OF_HEAD_LOGIT = -1e9
SMOOTH_ALPHA = 0.5                  # SmoothQuant migration strength: sqrt balance of act/weight ranges
SMOOTH_KEYS = ("qkv", "o", "gate_up", "down")  # per layer; "head" once


def has_default_drafter(path: Path = WEIGHTS_DIR) -> bool:
    return (path / DELTA_CONFIG).is_file() and (path / DELTA_WEIGHTS).is_file()


def drafter_meta(path: Path = WEIGHTS_DIR) -> dict:
    """``delta.json``: name, builder, num_layers, int8, draft_len and what the drafter measured."""
    return json.loads((path / DELTA_CONFIG).read_text())


def default_drafter_spec(device: str = "cpu", dtype: str = "float32", path: Path = WEIGHTS_DIR) -> ModelSpec:
    """The ModelSpec that loads the default drafter: the target (cut to the drafter's depth) + delta."""
    return ModelSpec(device=device, dtype=dtype, num_layers=int(drafter_meta(path)["num_layers"]),
                     delta=str(path))


# ----------------------------------------------------------------------------------- the module
@dataclass
class _Output:
    logits: torch.Tensor            # [B, logits_to_keep, V]
    past_key_values: object


class _Layer(torch.nn.Module):
    """One Llama decoder layer with fused q|k|v and gate|up projections."""

    def __init__(self, hf_layer, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        self.ln1 = torch.nn.Parameter(hf_layer.input_layernorm.weight.detach().clone(), requires_grad=False)
        self.ln2 = torch.nn.Parameter(hf_layer.post_attention_layernorm.weight.detach().clone(), requires_grad=False)
        self.qkv = _linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        self.o = _linear(a.o_proj.weight)
        self.gate_up = _linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        self.down = _linear(m.down_proj.weight)
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.inter = m.down_proj.weight.shape[1]

    def forward(self, x, cos, sin, cache, idx: int, mask):
        """x: [1, n, H]; cos, sin: [n, head_dim] (sin sign-folded, see _rope); mask: [1, 1, n, S] or None."""
        n, d = x.shape[1], self.head_dim
        qkv = self.qkv(F.rms_norm(x, x.shape[-1:], self.ln1, self.eps))
        qk = _rope(qkv[..., :(self.heads + self.kv_heads) * d].view(1, n, -1, d), cos, sin)  # q and k heads at once
        q = qk[:, :, :self.heads].transpose(1, 2)                                          # [1, h, n, d]
        k = qk[:, :, self.heads:].transpose(1, 2)                                          # [1, kv, n, d]
        v = qkv[..., (self.heads + self.kv_heads) * d:].view(1, n, self.kv_heads, d).transpose(1, 2)
        k, v = cache.update(k, v, idx)                                                     # [1, kv, S, d]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)      # [1, h, n, d]
        x = x + self.o(att.transpose(1, 2).reshape(1, n, self.heads * d))
        gate, up = self.gate_up(F.rms_norm(x, x.shape[-1:], self.ln2, self.eps)).split([self.inter, self.inter], dim=-1)
        return x + self.down(F.silu(gate) * up)


class LeanDrafter(torch.nn.Module):
    """A KV-cached Llama forward with the call signature :class:`~specdec.common.modeling.CachedLM`
    uses (``input_ids``, ``past_key_values`` (a transformers DynamicCache), ``position_ids``, optional
    boolean ``attention_mask`` [1, 1, n, S] for token trees, ``logits_to_keep``), returning
    full-vocabulary logits with :data:`OUT_OF_HEAD_LOGIT` outside the head.
    """

    def __init__(self, hf_model, keep_ids: torch.Tensor):
        super().__init__()
        cfg = hf_model.config
        _check_supported(cfg)
        self.config = cfg
        self.embed = hf_model.model.embed_tokens                              # shared with the target
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = torch.nn.ModuleList(
            _Layer(layer, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.rms_norm_eps)
            for layer in hf_model.model.layers)
        self.norm = torch.nn.Parameter(hf_model.model.norm.weight.detach().clone(), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        self.head = _linear(hf_model.get_output_embeddings().weight[keep_ids])   # [N, H] rows of the tied head
        self.register_buffer("keep_ids", keep_ids.long(), persistent=False)     # [N]
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta")
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)                                   # [d / 2]

    @torch.inference_mode()
    def forward(self, input_ids, past_key_values, position_ids=None, attention_mask=None,
                use_cache=True, logits_to_keep=0, **_):
        """input_ids: [1, n]; position_ids: [1, n] -> logits [1, k, V] (k = logits_to_keep or n)."""
        if input_ids.shape[0] != 1:
            raise ValueError("LeanDrafter runs one sequence at a time")
        n = input_ids.shape[1]
        start = past_key_values.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(start, start + n).unsqueeze(0)
        freqs = position_ids[0].float()[:, None] * self.inv_freq[None]           # [n, d / 2]
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)[:, None]             # [n, 1, d]
        sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)[:, None]            # sign of rotate_half folded in
        mask = attention_mask
        if mask is None and n > 1:  # causal over the new tokens, all of the cache visible
            mask = torch.ones(n, start + n, dtype=torch.bool, device=input_ids.device).tril(diagonal=start)[None, None]
        x = self.embed(input_ids)                                                # [1, n, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, past_key_values, i, mask)
        keep = logits_to_keep or n
        small = self.head(F.rms_norm(x[:, -keep:], x.shape[-1:], self.norm, self.eps))  # [1, k, N]
        out = small.new_full((*small.shape[:-1], self.config.vocab_size), OUT_OF_HEAD_LOGIT)
        return _Output(logits=out.index_copy_(-1, self.keep_ids, small), past_key_values=past_key_values)


def _check_supported(cfg) -> None:
    """LeanDrafter re-implements plain Llama only: refuse what it would silently compute wrong."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    problems = [what for what, bad in (
        (f"model_type {cfg.model_type!r}", cfg.model_type != "llama"),
        ("attention_bias", getattr(cfg, "attention_bias", False)),
        ("mlp_bias", getattr(cfg, "mlp_bias", False)),
        (f"rope_type {rope.get('rope_type')!r}", rope.get("rope_type", "default") != "default"),
        (f"hidden_act {cfg.hidden_act!r}", cfg.hidden_act != "silu")) if bad]
    if problems:
        raise ValueError(f"LeanDrafter supports plain Llama models only, not: {', '.join(problems)}")


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data.copy_(weight.detach())
    lin.weight.requires_grad_(False)
    return lin


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama: x cos + rotate_half(x) sin, with rotate_half(x) =
    (-x2, x1) = roll(x, d/2) * (-1, 1); the sign lives in ``sin``. x: [1, n, heads, d]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


# ------------------------------------------------------------------------------- smoothing + int8
def smooth(drafter: LeanDrafter, scales: dict[str, torch.Tensor]) -> None:
    """Fold SmoothQuant scales s into the weights: X W^T = (X / s)(W s)^T, exactly in float.

    X / s is folded into what produces X: the norm weight (qkv, gate_up, head), the v rows (o: per
    kv channel, shared by the query heads of a group) and the up rows (down, since silu(g) * u is
    linear in u).
    """
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            s = scales[f"{i}.qkv"]
            layer.ln1.div_(s)
            layer.qkv.weight.mul_(s)
            s = scales[f"{i}.gate_up"]
            layer.ln2.div_(s)
            layer.gate_up.weight.mul_(s)
            s = scales[f"{i}.o"]                                                 # [kv * d]
            kv = layer.kv_heads * layer.head_dim
            v_rows = slice(layer.heads * layer.head_dim + kv, layer.heads * layer.head_dim + 2 * kv)
            layer.qkv.weight[v_rows].div_(s[:, None])
            group = layer.heads // layer.kv_heads
            s_o = s.view(layer.kv_heads, 1, layer.head_dim).expand(-1, group, -1).reshape(-1)
            layer.o.weight.mul_(s_o)
            s = scales[f"{i}.down"]
            layer.gate_up.weight[layer.inter:].div_(s[:, None])
            layer.down.weight.mul_(s)
        s = scales["head"]
        drafter.norm.div_(s)
        drafter.head.weight.mul_(s)


def smoothing_scales(act_max: dict[str, torch.Tensor], drafter: LeanDrafter) -> dict[str, torch.Tensor]:
    """s_j = max|X_j|^a / max|W_j|^(1-a) per input channel (SmoothQuant eq. 4), from calibration maxima."""
    out = {}
    for key, amax in act_max.items():
        i, _, name = key.partition(".")
        if key == "head":
            w = drafter.head.weight
        else:
            w = getattr(drafter.layers[int(i)], name).weight
        if name == "o":  # one scale per kv channel: the max over the query heads sharing it
            layer = drafter.layers[int(i)]
            group = layer.heads // layer.kv_heads
            wmax = w.abs().amax(0).view(layer.kv_heads, group, layer.head_dim).amax(1).reshape(-1)
            amax = amax.view(layer.kv_heads, group, layer.head_dim).amax(1).reshape(-1)
        else:
            wmax = w.abs().amax(0)
        s = amax.clamp_min(1e-5) ** SMOOTH_ALPHA / wmax.clamp_min(1e-5) ** (1 - SMOOTH_ALPHA)
        out[key] = s.clamp_min(1e-5).float()
    return out


@torch.inference_mode()
def calibrate(drafter: LeanDrafter, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |activation| of every linear over ``sequences`` (float drafter)."""
    from transformers import DynamicCache

    act_max: dict[str, torch.Tensor] = {}

    def hook(key):
        def record(_module, inputs, _output):
            a = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            act_max[key] = a if key not in act_max else torch.maximum(act_max[key], a)
        return record

    handles = [getattr(layer, name).register_forward_hook(hook(f"{i}.{name}"))
               for i, layer in enumerate(drafter.layers) for name in SMOOTH_KEYS]
    handles.append(drafter.head.register_forward_hook(hook("head")))
    try:
        for ids in sequences:
            drafter(torch.tensor([ids]), DynamicCache(config=drafter.config))
    finally:
        for h in handles:
            h.remove()
    return act_max


class _RowScaled(torch.nn.Module):
    """A dynamic-int8 linear whose activation scale is, in effect, per row (token).

    fbgemm picks one activation scale per call, so in a multi-token call (the prompt, or the
    correction token with the last draft) one outlier token coarsens all others. Dividing each row
    by its max |x| first (and multiplying the output back: the map is linear) makes the one scale
    fit every row. Measured on held-out answers: +0.02 acceptance at T = 0, +0.04 at T = 1.
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] == 1:
            return self.inner(x)
        m = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)                      # [..., n, 1]
        return self.inner(x / m) * m


def quantize_int8(drafter: LeanDrafter) -> None:
    """int8 weights (per output channel) with dynamic int8 activations for every linear (CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao eager quantization announces its move to torchao
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        torch.ao.quantization.quantize_dynamic(drafter, {torch.nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
    for layer in drafter.layers:
        for name in SMOOTH_KEYS:
            setattr(layer, name, _RowScaled(getattr(layer, name)))
    drafter.head = _RowScaled(drafter.head)


def build(model, extra: dict[str, torch.Tensor], meta: dict, device: torch.device) -> LeanDrafter:
    """The ``delta.json`` builder: target (truncated to ``num_layers``) + head ids + scales -> drafter.

    int8 only on CPU (fbgemm); elsewhere the smoothed float drafter runs (same distribution family,
    slightly different numbers: the device always sends the q it sampled from, so still lossless).
    """
    keep = extra[HEAD_IDS].long()
    if keep.ndim != 1 or int(keep.min()) < 0 or int(keep.max()) >= model.config.vocab_size:
        raise ValueError("head ids outside the vocabulary")
    drafter = LeanDrafter(model, keep)
    scales = {k.removeprefix("smooth."): v.float() for k, v in extra.items() if k.startswith("smooth.")}
    if scales:
        smooth(drafter, scales)
    if meta.get("int8") and device.type == "cpu":
        quantize_int8(drafter)
    return drafter


def save_drafter(path: Path, keep_ids: torch.Tensor, scales: dict[str, torch.Tensor], meta: dict) -> None:
    """Write the delta: head ids, smoothing scales (float16) and ``delta.json``."""
    from safetensors.torch import save_file

    tensors = {HEAD_IDS: keep_ids.to(torch.int64).contiguous()}
    tensors |= {f"smooth.{k}": v.to(torch.float16).contiguous() for k, v in scales.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / DELTA_WEIGHTS))
    (path / DELTA_CONFIG).write_text(json.dumps({"builder": BUILDER, **meta}, indent=2) + "\n")


