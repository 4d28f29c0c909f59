"""Tiny random causal LMs (Llama architecture) saved as real HF checkpoints for tests and benches.

Target and drafter are different models sharing one word-level vocabulary, written to a directory
with ``save_pretrained`` and loaded back through the same loading code as real checkpoints.
"""
from __future__ import annotations

from pathlib import Path

import torch

EOS_ID = 1  # "<eos>"; id 0 is "<unk>"


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": EOS_ID}
    vocab.update({f"w{i}": i + 2 for i in range(vocab_size - 2)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


BYTE_VOCAB = 258  # "<unk>", "<eos>", then one token per byte


def make_byte_tokenizer():
    """A byte-level tokenizer (GPT-2's byte-to-unicode alphabet, no merges): any text, JSON included,
    is some sequence of its tokens, and a grammar engine reads its tokens' bytes from its decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<eos>": EOS_ID, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _random_llama(vocab_size: int, seed: int, hidden: int, layers: int, max_positions: int):
    """A random Llama (untied head, 4 heads over 2 key/value heads, wide initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, eos_token_id=EOS_ID, bos_token_id=None,
        pad_token_id=0, tie_word_embeddings=False, initializer_range=0.2,
    ))


def _save(model, vocab_size: int, path: Path, byte_level: bool = False) -> Path:
    model.save_pretrained(path)
    (make_byte_tokenizer() if byte_level else make_tokenizer(vocab_size)).save_pretrained(path)
    return path


def make_model(path: Path, vocab_size: int, *, seed: int, hidden: int = 32, layers: int = 2,
               logit_scale: float = 4.0, max_positions: int = 256, byte_level: bool = False) -> Path:
    """Save a random Llama with peaky, context-dependent next-token distributions to ``path``
    (``byte_level``: over :func:`make_byte_tokenizer`'s vocabulary, whose size it must be)."""
    assert not byte_level or vocab_size == BYTE_VOCAB, vocab_size
    model = _random_llama(vocab_size, seed, hidden, layers, max_positions)
    with torch.no_grad():  # sharpen the head so distributions are far from uniform
        model.lm_head.weight.mul_(logit_scale)
    return _save(model, vocab_size, path, byte_level)


def make_pair(root: Path, vocab_size: int, *, target_seed: int = 1, draft_seed: int = 2,
              **kw) -> tuple[Path, Path]:
    """A target and a (different) drafter over the same vocabulary."""
    target = make_model(root / f"target-v{vocab_size}", vocab_size, seed=target_seed, layers=2, **kw)
    drafter = make_model(root / f"draft-v{vocab_size}", vocab_size, seed=draft_seed, layers=1, **kw)
    return target, drafter


def make_close_drafter(target: Path, path: Path, *, noise: float, seed: int = 3) -> Path:
    """A drafter that is the target with every weight perturbed by ``noise`` x its std: a distinct
    model whose q is close to p, as a distilled drafter's is (high acceptance, which is what gives
    statistical tests power against sampling bugs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise * param.std().clamp_min(1e-3))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return path


def make_sharpened_drafter(target: Path, path: Path, *, scale: float) -> Path:
    """A drafter that is the target at temperature 1 / ``scale``: q is p sharpened (scale > 1), so its
    rejections leave a residual norm(max(0, p - q)) on p's tail, far from p itself. Tests whose
    controls swap a residual draw for a draw from p get their power from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return path


def make_margin_model(path: Path, vocab_size: int, *, seed: int, hidden: int = 64, layers: int = 2,
                      residual_scale: float = 0.02, max_positions: int = 256) -> Path:
    """A random Llama whose greedy choice has a wide margin at every step, for bfloat16 identity
    tests: the attention and MLP branches are scaled down (the last token's embedding dominates the
    final hidden state; the context moves the logits, not the greedy choice) and the head reads the
    embedding through a fixed permutation, so the next token is a fixed function of the last one with
    a margin of ~20 % of the top logit or more, far above bfloat16 rounding. A near tie, which
    rounding could flip between a batched and a single forward, does not occur (a random model has
    them every few dozen tokens). Attention itself is tested in float32."""
    model = _random_llama(vocab_size, seed, hidden, layers, max_positions)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
        perm = torch.randperm(vocab_size)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[perm] * 4.0)
    return _save(model, vocab_size, path)


def make_random_drafter(path: Path, tokenizer, *, seed: int, hidden: int = 32, layers: int = 1) -> Path:
    """A random Llama over ``tokenizer``'s vocabulary, saved with that tokenizer: a drafter that shares a
    real target's vocabulary (the edge accepts it) and almost never guesses its tokens."""
    vocab_size = len(tokenizer)
    model = _random_llama(vocab_size, seed, hidden, layers, max_positions=2048)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
