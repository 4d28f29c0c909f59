"""The check's targets: random-initialised Llama-shaped models built from configs on the device.

No checkpoint travels to a lent GPU machine (64 MiB of working tree), so the models are made there
from configs: the embedded target's (SmolLM2-135M-Instruct), a ~1B and a ~8B Llama-shaped one
(Llama 3.2 1B's and Llama 3.1 8B's shapes), plus tiny ones for the CPU smoke run. Their weights are
random with two changes that leave every shape, and so every cost, as it is:

- the attention and MLP output projections are scaled by RESIDUAL_SCALE, so the final hidden state is
  dominated by the last token's embedding;
- an untied head reads the embedding through a fixed permutation (a tied one reads it directly).

Then the greedy next token is a fixed function of the last one, with a margin of tens of logits: a
batched forward's bfloat16 rounding can never flip it, so greedy identity can be checked exactly and
proposals taken from the target's own greedy path keep the acceptance they were built with (a
random model has near ties every few dozen tokens). The check records the smallest margin it saw.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.common.modeling import serving_attention

RESIDUAL_SCALE = 1e-4   # branch outputs ~16 x this per component over 32 layers, against 0.02 of the embedding
SEED = 1234


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped config (the fields that decide its cost)."""
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    rope_theta: float
    max_positions: int = 8192

    def config(self):
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
                           max_position_embeddings=self.max_positions, tie_word_embeddings=self.tied,
                           rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
                           rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)


SHAPES = {s.name: s for s in (
    # the embedded default target (its GGUF's config)
    Shape("smollm2-135m", 49152, 576, 1536, 30, 9, 3, tied=True, rope_theta=1e5),
    # Llama 3.2 1B's shape (1.24B parameters)
    Shape("llama-1b", 128256, 2048, 8192, 16, 32, 8, tied=True, rope_theta=5e5),
    # Llama 3.1 8B's shape (8.03B parameters)
    Shape("llama-8b", 128256, 4096, 14336, 32, 32, 8, tied=False, rope_theta=5e5),
    # the CPU smoke run's
    Shape("tiny-a", 512, 64, 128, 2, 4, 2, tied=True, rope_theta=1e4, max_positions=4096),
    Shape("tiny-b", 1024, 96, 192, 3, 6, 2, tied=False, rope_theta=1e4, max_positions=4096),
)}
GPU_MODELS = ("smollm2-135m", "llama-1b", "llama-8b")
SMOKE_MODELS = ("tiny-b",)


def build(shape: Shape, device: str, dtype: torch.dtype):
    """The model, made directly on ``device`` in ``dtype`` (an 8B model initialised on a CPU would
    take minutes), eval mode."""
    from transformers import AutoModelForCausalLM

    serving_attention(torch.device(device))  # as load_model: the edge's attention backends
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_SCALE)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
        if not shape.tied:
            g = torch.Generator(device="cpu").manual_seed(SEED)
            perm = torch.randperm(shape.vocab, generator=g).to(device)
            model.lm_head.weight.copy_(model.model.embed_tokens.weight[perm])
    return model.eval()


def tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` entries and no end-of-sequence token (sessions run to their
    length)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def save(model, shape: Shape, path: Path) -> dict:
    """Write an HF checkpoint the edge-server loads (``--model path``); its size and seconds."""
    t0 = time.perf_counter()
    model.save_pretrained(path)
    tokenizer(shape.vocab).save_pretrained(path)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {"path": str(path), "bytes": size, "seconds": time.perf_counter() - t0}


def parameter_bytes(model) -> int:
    """Bytes of the weights one forward reads (a tied head counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def describe(shape: Shape, model) -> dict:
    return {"shape": shape.__dict__, "parameters": sum(p.numel() for p in {p.data_ptr(): p for p in
                                                                            model.parameters()}.values()),
            "weight_bytes": parameter_bytes(model), "residual_scale": RESIDUAL_SCALE,
            "config": json.loads(shape.config().to_json_string())}
