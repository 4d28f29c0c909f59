"""The built-drafter cache: a drafter built once from the target is kept and memory-mapped on later starts.

A builder may be slow and memory-hungry (the default drafter loads the float32 target and packs its
int4 weights: ~1.5 GB and seconds on every start). If the drafter's delta.json asks for it
(PREBUILT_FLAG) and its builder comes with a :class:`PrebuiltCache`, the built tensors are kept once
under ``$SPECDEC_CACHE_DIR`` and later loads read them (memory-mapped) without building the float
model. Opt-in, so that the many throwaway drafters tests build do not pile up in the user's cache.
:func:`specdec.common.modeling.load_model` asks the cache (common/modeling.py's ``BuiltCache``);
what is cached, and how it is read back, is the device's business.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.common.modeling import (DELTA_CONFIG, DELTA_WEIGHTS, DeltaBuilder, LoadedModel, ModelSpec, cache_root,
                                     named_builder, source_identity)

log = logging.getLogger(__name__)

PREBUILT_FLAG = "cache_prebuilt"
PREBUILT_WEIGHTS = "drafter.pt"
PREBUILT_MANIFEST = "manifest.json"
CHECKSUM_CHUNK = 1 << 22    # bytes per read while checksumming (crc32 of ~230 MB: ~0.1 s)


@dataclass(frozen=True)
class PrebuiltCache:
    """A builder's cache: ``load_prebuilt(config, state, info, device)`` rebuilds the module from what
    its ``prebuilt_state()`` saved; ``version`` of that output is part of the key."""
    load_prebuilt: Callable
    version: int = 0

    def entry(self, spec: ModelSpec, source: str, kwargs: dict, device: torch.device) -> Path | None:
        """Where the drafter ``spec`` builds is kept, or None if it is not cacheable. The key covers
        all it depends on: the source files, the delta's recipe and tensors, the layers, dtype and
        device, the builder's ``version`` and torch's version (the int4 packing is torch's own layout)."""
        delta = Path(spec.delta)
        meta_text = (delta / DELTA_CONFIG).read_text()
        meta = json.loads(meta_text)
        builder = named_builder(meta, spec.builder)
        identity = source_identity(source, kwargs)
        if not meta.get(PREBUILT_FLAG) or builder is None or builder.cache is not self or identity is None:
            return None
        parts = [identity, meta_text, hashlib.sha256((delta / DELTA_WEIGHTS).read_bytes()).hexdigest(),
                 str(spec.num_layers), spec.dtype, device.type, str(self.version), torch.__version__]
        key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return cache_root() / f"drafter-{meta.get('name', delta.name)}-{key}"

    def load(self, path: Path, builder: DeltaBuilder, device: torch.device) -> LoadedModel | None:
        """The cached drafter, or None when there is none or it is unreadable (then it is removed, and
        the caller builds and saves it again)."""
        if not (path / PREBUILT_MANIFEST).is_file():
            return None
        # The checksum runs beside the rest of the load (zlib and file reads release the GIL).
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            crc = pool.submit(_crc32, path / PREBUILT_WEIGHTS)
            try:
                manifest, loaded = self._read(path, device)
                if crc.result() != manifest["crc32"]:
                    raise ValueError("checksum mismatch")
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                log.warning("drafter cache %s is unreadable (%s): rebuilding it", path, exc)
                crc.cancel()
                shutil.rmtree(path, ignore_errors=True)
                return None
        return loaded

    def _read(self, path: Path, device: torch.device) -> tuple[dict, LoadedModel]:
        from transformers import PretrainedConfig

        manifest = json.loads((path / PREBUILT_MANIFEST).read_text())
        state = torch.load(path / PREBUILT_WEIGHTS, mmap=True, weights_only=True)  # pages are read as used
        # The base config class with config.json's fields: AutoConfig / LlamaConfig would import
        # transformers' model stack (~1.5 s and ~90 MB here), and the drafter only reads the fields.
        config = PretrainedConfig(**json.loads((path / "config.json").read_text()))
        model = self.load_prebuilt(config, state, manifest["info"], device).to(device).eval()
        tokenizer = _tokenizer_class(path).from_pretrained(path)
        return manifest, LoadedModel(model=model, tokenizer=tokenizer, name=manifest["name"], device=device)

    def save(self, model: torch.nn.Module, tokenizer, name: str, path: Path) -> None:
        """Write the built drafter, its config and tokenizer to a temporary directory and rename it
        into place (atomic: a reader sees all of it or nothing). Best effort, like the GGUF cache."""
        built = model.prebuilt_state() if hasattr(model, "prebuilt_state") else None
        if built is None or path.exists():
            return
        state, info, meta = built
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            tmp.mkdir(parents=True)
            torch.save(state, tmp / PREBUILT_WEIGHTS)
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            tokenizer.save_pretrained(tmp)
            (tmp / PREBUILT_MANIFEST).write_text(json.dumps(
                {"name": name, "meta": meta, "info": info, "crc32": _crc32(tmp / PREBUILT_WEIGHTS)}, indent=2))
            tmp.rename(path)
        except OSError as exc:
            log.warning("could not cache the drafter in %s (%s)", path, exc)
            shutil.rmtree(tmp, ignore_errors=True)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(CHECKSUM_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _tokenizer_class(path: Path):
    """The tokenizer class saved in ``path`` (``tokenizer_config.json``), imported directly: importing
    AutoTokenizer's registry costs a warm start ~0.35 s, and without a config it loads AutoConfig
    (~1.5 s, transformers' model stack). AutoTokenizer only for a class transformers does not export."""
    import transformers

    name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return cls if cls is not None and hasattr(cls, "from_pretrained") else transformers.AutoTokenizer
