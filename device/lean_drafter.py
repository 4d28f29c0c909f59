"""The default drafter for the embedded target (SmolLM2-135M-Instruct).

What it is: the target itself, computed the way a CPU device computes it fast. The target ships as a
Q4_1 GGUF: every weight of its decoder layers is a 4-bit code times a float16 step plus a minimum,
per group of 32, which transformers dequantizes to float32 (the edge verifies with that float32
model). The drafter takes the same 4-bit codes back (:func:`q4_1_quantize` recovers them exactly
from the float32 weights) and runs them with torch's int4 CPU kernel on bfloat16 activations, so a
decode step reads ~7x fewer bytes than the float32 target's. Its only departures from the target are
bfloat16 rounding and the LM head (float16 with ``head_dtype``: :class:`HalfHead`), which covers only
the ``N`` tokens the target emits most (q = 0
elsewhere: the device never drafts a token outside the head, and the edge verifies against exactly
that q, so the system stays lossless). A plain KV-cached forward replaces the transformers module
stack.

What is committed (``drafter_weights/``, only what differs from the target): the head's token ids
and ``delta.json``. The weights themselves are the target's, read at load time through
:func:`specdec.common.modeling.load_model` (``ModelSpec.delta``, built by this module's :func:`build`,
which :func:`default_drafter_spec` passes in as ``ModelSpec.builder``: :data:`DELTA_BUILDER`), so
drafter and target share their tokenizer and loading code exactly; what :func:`build` makes is cached
once (``delta.json``'s ``cache_prebuilt``) and later starts read it back through
:func:`load_prebuilt` without the float32 target. How the files were made and what
the drafter measures: ``drafter_weights/README.md``; the recipe: ``make drafter``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.common.modeling import DELTA_CONFIG, DELTA_WEIGHTS, DeltaBuilder, ModelSpec
from specdec.device.prebuilt import PrebuiltCache

WEIGHTS_DIR = Path(__file__).resolve().parent / "drafter_weights"
BUILDER = "specdec.device.lean_drafter:build"  # delta.json's record of who builds it (DELTA_BUILDER)
HEAD_IDS = "head.keep_ids"          # [N] int64: vocabulary ids the head covers, sorted
# Logit of the tokens the head leaves out: finite (the codecs refuse inf), and exp() of it minus any
# real logit is exactly 0 in float32 at every temperature <= 1e4, so q = 0 there.
OUT_OF_HEAD_LOGIT = -1e9
LAYER_LINEARS = ("qkv", "o", "gate_up", "down")  # the projections of one _Layer
GROUP = 32              # Q4_1's block: 32 consecutive input weights share a step and a minimum
Q4_LEVELS = 15          # codes 0..15
INT4_ROWS_MULTIPLE = 16  # the CPU int4 kernel packs output rows in tiles of 16
INNER_K_TILES = 2       # packing parameter of _convert_weight_to_int4pack_for_cpu (any of 1,2,4,8: same speed here)
# What build() computes from the target and delta.json, as a version: part of the key of the prebuilt
# drafter in the cache (common/modeling.py), so bump it whenever build()'s output changes.
PREBUILT_VERSION = 1


def has_default_drafter(path: Path = WEIGHTS_DIR) -> bool:
    return (path / DELTA_CONFIG).is_file() and (path / DELTA_WEIGHTS).is_file()


def drafter_meta(path: Path = WEIGHTS_DIR) -> dict:
    """``delta.json``: name, builder, num_layers, int4, draft_len and what the drafter measured."""
    return json.loads((path / DELTA_CONFIG).read_text())


def default_drafter_spec(device: str = "cpu", dtype: str = "float32", path: Path = WEIGHTS_DIR) -> ModelSpec:
    """The ModelSpec that loads the default drafter: the target (cut to the drafter's depth) + delta,
    built by this module (:data:`DELTA_BUILDER`)."""
    return ModelSpec(device=device, dtype=dtype, num_layers=int(drafter_meta(path)["num_layers"]),
                     delta=str(path), builder=DELTA_BUILDER)


# ----------------------------------------------------------------------------------- the module
@dataclass
class _Output:
    logits: torch.Tensor            # [B, logits_to_keep, V]
    past_key_values: object


class _Layer(torch.nn.Module):
    """One Llama decoder layer with fused q|k|v and gate|up projections (each a float
    ``torch.nn.Linear`` or an :class:`Int4Linear`)."""

    def __init__(self, ln1, ln2, qkv, o, gate_up, down, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.ln1 = torch.nn.Parameter(ln1, requires_grad=False)                     # [H]
        self.ln2 = torch.nn.Parameter(ln2, requires_grad=False)                     # [H]
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.inter = gate_up.out_features // 2

    @classmethod
    def from_hf(cls, hf_layer, heads: int, kv_heads: int, head_dim: int, eps: float) -> "_Layer":
        a, m = hf_layer.self_attn, hf_layer.mlp
        return cls(hf_layer.input_layernorm.weight.detach().clone(),
                   hf_layer.post_attention_layernorm.weight.detach().clone(),
                   _linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])), _linear(a.o_proj.weight),
                   _linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])), _linear(m.down_proj.weight),
                   heads, kv_heads, head_dim, eps)

    def forward(self, x, cos, sin, cache, idx: int, mask):
        """x: [n, H], the one sequence's hidden states (2-D all through: no reshapes around the int4
        kernel, which takes [rows, K]); cos, sin: [n, 1, d] (sin sign-folded, see _rope);
        mask: [1, 1, n, S] or None."""
        n, d, h, kv = x.shape[0], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(F.rms_norm(x, self.ln1.shape, self.ln1, self.eps))                 # [n, (h + 2 kv) d]
        qk = _rope(qkv[:, :(h + kv) * d].view(n, h + kv, d), cos, sin)                  # q and k heads at once
        q = qk[:, :h].transpose(0, 1).unsqueeze(0)                                      # [1, h, n, d]
        k = qk[:, h:].transpose(0, 1).unsqueeze(0)                                      # [1, kv, n, d]
        v = qkv[:, (h + kv) * d:].view(n, kv, d).transpose(0, 1).unsqueeze(0)          # [1, kv, n, d]
        k, v = cache.update(k, v, idx)                                                  # [1, kv, S, d]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)   # [1, h, n, d]
        x = x + self.o(att[0].transpose(0, 1).reshape(n, h * d))
        gate, up = self.gate_up(F.rms_norm(x, self.ln2.shape, self.ln2, self.eps)).split([self.inter, self.inter], dim=-1)
        return x + self.down(F.silu(gate) * up)


class LeanDrafter(torch.nn.Module):
    """A KV-cached Llama forward with the call signature :class:`~specdec.common.modeling.CachedLM`
    uses (``input_ids``, ``past_key_values`` (a transformers DynamicCache), ``position_ids``, optional
    boolean ``attention_mask`` [1, 1, n, S] for token trees, ``logits_to_keep``), returning
    full-vocabulary logits with :data:`OUT_OF_HEAD_LOGIT` outside the head.
    """

    def __init__(self, config, embed: torch.Tensor, layers: list[_Layer], norm: torch.Tensor,
                 head: torch.nn.Module, keep_ids: torch.Tensor):
        super().__init__()
        _check_supported(config)
        self.config = config
        self.embed = torch.nn.Embedding.from_pretrained(embed, freeze=True)            # [V, H]
        self.layers = torch.nn.ModuleList(layers)
        self.norm = torch.nn.Parameter(norm, requires_grad=False)                      # [H]
        self.eps = config.rms_norm_eps
        self.head = head                                                               # [N, H] rows of the tied head
        self.register_buffer("keep_ids", keep_ids.long())                              # [N]
        head_dim = _head_dim(config)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta")
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)                                          # [d / 2]

    @classmethod
    def from_hf(cls, hf_model, keep_ids: torch.Tensor) -> "LeanDrafter":
        """The float drafter from a transformers Llama (shares its token embeddings)."""
        cfg = hf_model.config
        _check_supported(cfg)
        layers = [_Layer.from_hf(layer, cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg),
                                 cfg.rms_norm_eps) for layer in hf_model.model.layers]
        return cls(cfg, hf_model.model.embed_tokens.weight.detach(), layers,
                   hf_model.model.norm.weight.detach().clone(),
                   _linear(hf_model.get_output_embeddings().weight[keep_ids]), keep_ids)

    @classmethod
    def from_state(cls, config, state: dict[str, torch.Tensor]) -> "LeanDrafter":
        """The drafter back from its own ``state_dict()`` (float or int4 linears), without copying
        the tensors: what :func:`load_prebuilt` uses, so a warm start never builds the float model."""
        def linear(prefix: str) -> torch.nn.Module:
            if f"{prefix}.packed" in state:
                return Int4Linear(state[f"{prefix}.packed"], state[f"{prefix}.scales_and_zeros"])
            if state[f"{prefix}.weight"].dtype == torch.float16 and prefix == "head":
                return HalfHead(state[f"{prefix}.weight"])
            return _linear(state[f"{prefix}.weight"], copy=False)

        layers = [_Layer(state[f"layers.{i}.ln1"], state[f"layers.{i}.ln2"],
                         *(linear(f"layers.{i}.{name}") for name in LAYER_LINEARS),
                         config.num_attention_heads, config.num_key_value_heads, _head_dim(config),
                         config.rms_norm_eps) for i in range(config.num_hidden_layers)]
        return cls(config, state["embed.weight"], layers, state["norm"], linear("head"), state["keep_ids"])

    def prebuilt_state(self) -> tuple[dict[str, torch.Tensor], dict, dict] | None:
        """(tensors, info, delta meta) for the prebuilt-drafter cache (common/modeling.py); None off
        the CPU: the cache is for the int4 CPU build, elsewhere the float drafter is built as before."""
        if self.norm.device.type != "cpu":
            return None
        info = {"int4_exact_fraction": getattr(self, "int4_exact_fraction", None)}
        return self.state_dict(), info, getattr(self, "delta_meta", {"builder": BUILDER})

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
        x = self.embed(input_ids[0])                                             # [n, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, past_key_values, i, mask)
        keep = logits_to_keep or n
        small = self.head(F.rms_norm(x[-keep:], self.norm.shape, self.norm, self.eps))  # [k, N]
        out = small.new_full((1, small.shape[0], self.config.vocab_size), OUT_OF_HEAD_LOGIT)
        return _Output(logits=out.index_copy_(-1, self.keep_ids, small[None]), past_key_values=past_key_values)


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


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _linear(weight: torch.Tensor, copy: bool = True) -> torch.nn.Linear:
    """A frozen bias-free linear layer holding ``weight`` [N, K] (a copy of it, or itself)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight.detach().clone() if copy else weight, requires_grad=False)
    return lin


class HalfHead(torch.nn.Module):
    """The reduced LM head with float16 weights and arithmetic, float32 logits out. The head is the
    target's tied embedding, stored in its GGUF as Q8_0 (an int8 times a float16 step per 32), so
    float16 keeps ~11 significant bits of each weight. Against the float32 head: 1.5-1.7 ms less
    per drafted token on this CPU (half the bytes) and logits within ~0.03 (float16 output
    rounding); the card (drafter_weights/README.md) has the acceptance it measured."""

    def __init__(self, weight: torch.Tensor):                                       # [N, H]
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().to(torch.float16), requires_grad=False)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:                             # [k, H] -> [k, N]
        return F.linear(x.to(torch.float16), self.weight).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama: x cos + rotate_half(x) sin, with rotate_half(x) =
    (-x2, x1) = roll(x, d/2) * (-1, 1); the sign lives in ``sin``. x: [1, n, heads, d]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


# ------------------------------------------------------------------------------------ int4 weights
def q4_1_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes with GGUF Q4_1's rule (ggml ``quantize_row_q4_1_ref``): every :data:`GROUP`
    consecutive input weights of a row share a minimum m and a step d = (max - m) / 15 (float16, as
    Q4_1 stores it), and w ~ d * code + m with code in 0..15.

    weight: [N, K] float -> (codes [N, K] int32, step [N, K / GROUP] float32, minimum [N, K / GROUP]).
    Paired with :func:`q4_1_dequantize`. Weights that came from a Q4_1 file (the embedded target's
    linear layers) round-trip exactly; any other weight is off by at most d / 2 (plus the float16
    rounding of d times the code).
    """
    assert weight.ndim == 2 and weight.shape[1] % GROUP == 0, weight.shape
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)                     # [N, K/G, G]
    minimum = groups.amin(-1)                                                          # [N, K/G]
    step = ((groups.amax(-1) - minimum) / Q4_LEVELS).half().float()                    # [N, K/G]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((groups - minimum[..., None]) / safe[..., None]).round().clamp(0, Q4_LEVELS)
    return codes.to(torch.int32).reshape(n, k), step, minimum


def q4_1_dequantize(codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """d * code + m per group, in float32 as ggml dequantizes Q4_1: [N, K] float32."""
    n, k = codes.shape
    assert step.shape == minimum.shape == (n, k // GROUP), (step.shape, minimum.shape)
    groups = codes.float().reshape(n, k // GROUP, GROUP)
    return (groups * step[..., None] + minimum[..., None]).reshape(n, k)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(torch.nn.Module):
    """A bias-free linear layer with Q4_1 weights, run by torch's CPU int4 kernel.

    The kernel (``_weight_int4pack_mm_for_cpu``, the one gpt-fast and torchao use) computes
    x ((code - 8) s + z)^T with bfloat16 activations, scales and output: so s = d and z = m + 8 d,
    both rounded to bfloat16. Its float32 path is far slower, hence bfloat16. A decode step
    reads 4.5 bits per weight instead of 32.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, exact_fraction: float = float("nan")):
        super().__init__()
        self.out_features = scales_and_zeros.shape[1]
        self.exact_fraction = exact_fraction   # of the float weights it was made from (nan: not known here)
        self.register_buffer("packed", packed)                                          # the kernel's tiles
        self.register_buffer("scales_and_zeros", scales_and_zeros)                      # [K/G, N, 2] bfloat16

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int4Linear":                          # [N, K]
        n, k = weight.shape
        if n % INT4_ROWS_MULTIPLE or k % GROUP:
            raise ValueError(f"int4 needs out_features % {INT4_ROWS_MULTIPLE} == 0 and in_features % {GROUP} == 0, "
                             f"got {tuple(weight.shape)}")
        codes, step, minimum = q4_1_quantize(weight)
        exact = float((q4_1_dequantize(codes, step, minimum) == weight.float()).float().mean())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        scales_and_zeros = torch.stack([step, minimum + 8 * step], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scales_and_zeros.to(torch.bfloat16), exact)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, K] (LeanDrafter's layout; other shapes are reshaped) -> [rows, N] in x's dtype."""
        if x.ndim != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_and_zeros)
        return y.to(x.dtype)


def quantize_int4(drafter: LeanDrafter) -> float:
    """Every decoder-layer linear -> :class:`Int4Linear` (the head stays float32 or float16: its int8
    or bfloat16 versions cost acceptance, see drafter_weights/README.md). Returns the fraction of weights the
    4-bit grid reproduces exactly (1.0 for a target loaded from a Q4_1 GGUF)."""
    exact = total = 0.0
    for layer in drafter.layers:
        for name in LAYER_LINEARS:
            lin = Int4Linear.from_float(getattr(layer, name).weight)
            setattr(layer, name, lin)
            numel = lin.packed.numel() * 2
            exact, total = exact + lin.exact_fraction * numel, total + numel
    return exact / max(total, 1.0)


def build(model, extra: dict[str, torch.Tensor], meta: dict, device: torch.device) -> LeanDrafter:
    """The ``delta.json`` builder: target + head ids -> drafter (int4 decoder layers on CPU; the head
    in float16 if ``head_dtype`` says so, else float32).

    int4 only on CPU with torch's int4 kernel; elsewhere (CUDA) the float drafter runs: a different
    q, still lossless, because the device always sends the q it sampled from.
    """
    keep = extra[HEAD_IDS].long()
    if keep.ndim != 1 or int(keep.min()) < 0 or int(keep.max()) >= model.config.vocab_size:
        raise ValueError("head ids outside the vocabulary")
    drafter = LeanDrafter.from_hf(model, keep)
    drafter.delta_meta = meta
    if meta.get("head_dtype", "float32") == "float16":
        drafter.head = HalfHead(drafter.head.weight)
    if meta.get("int4") and device.type == "cpu" and int4_kernel_available():
        drafter.int4_exact_fraction = quantize_int4(drafter)
    return drafter


def load_prebuilt(config, state: dict[str, torch.Tensor], info: dict, device: torch.device) -> LeanDrafter:
    """What :func:`build` made, back from its cached tensors (the cache's loader calls this)."""
    drafter = LeanDrafter.from_state(config, state)
    if info.get("int4_exact_fraction") is not None:
        drafter.int4_exact_fraction = info["int4_exact_fraction"]
    return drafter


# What ModelSpec.builder carries for a delta that names BUILDER: the loader calls these, never imports them.
DELTA_BUILDER = DeltaBuilder(name=BUILDER, build=build, cache=PrebuiltCache(load_prebuilt, PREBUILT_VERSION))


def save_drafter(path: Path, keep_ids: torch.Tensor, meta: dict) -> None:
    """Write the delta: the head's token ids and ``delta.json``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({HEAD_IDS: keep_ids.to(torch.int64).contiguous()}, str(path / DELTA_WEIGHTS))
    (path / DELTA_CONFIG).write_text(json.dumps({"builder": BUILDER, **meta}, indent=2) + "\n")
