"""The prebuilt-drafter cache (device/prebuilt.py): a drafter whose delta.json asks for it is
built once, kept in ``$SPECDEC_CACHE_DIR``, and later loads read it back without building the float
model. On a tiny random Llama through the same code path as the default drafter (ModelSpec.delta,
built by ModelSpec.builder = lean_drafter.DELTA_BUILDER):

- the cached drafter's logits are bit-identical to the freshly built one's (full and token by token);
- a warm load never calls ``from_pretrained`` for the model (the float target is not materialised);
- a corrupt or truncated cache is rebuilt, and a changed recipe or source gets its own entry.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.common import modeling
from specdec.common.modeling import CachedLM, ModelSpec, load_model
from specdec.device import lean_drafter
from specdec.device.prebuilt import PREBUILT_FLAG, PREBUILT_MANIFEST, PREBUILT_WEIGHTS
from specdec.testbed.tiny_models import make_model

VOCAB = 64
IDS = [5, 9, 2, 33, 17, 8, 41, 12, 60, 3, 22, 7]
PREFIX = 4


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    return root


@pytest.fixture()
def builds(monkeypatch) -> list[str]:
    """Counts the float model loads (from_pretrained), i.e. the builds the cache did not save."""
    from transformers import AutoModelForCausalLM

    calls, real = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: calls.append(str(a[0])) or real(*a, **kw))
    return calls


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("prebuilt") / "target", VOCAB, seed=5, hidden=32, layers=2)


def _delta(path: Path, **meta) -> Path:
    keep = torch.arange(0, VOCAB, 2)
    lean_drafter.save_drafter(path, keep, {"name": "tiny", "num_layers": 2, "int4": True, PREBUILT_FLAG: True, **meta})
    return path


def _spec(target: Path, delta: Path) -> ModelSpec:
    return ModelSpec(model=str(target), delta=str(delta), builder=lean_drafter.DELTA_BUILDER)


def _logits(loaded) -> torch.Tensor:
    """[2T, V]: one forward over IDS, then a prefix and one token at a time through the KV cache."""
    full = CachedLM(loaded.model, loaded.device).forward(IDS, num_logits=len(IDS))
    lm = CachedLM(loaded.model, loaded.device)
    rows = [lm.forward(IDS[:PREFIX], num_logits=PREFIX)] + [lm.forward([t], num_logits=1) for t in IDS[PREFIX:]]
    return torch.cat([full, *rows])


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("drafter-tiny-*") if p.is_dir())


@pytest.mark.parametrize("head_dtype", ["float32", "float16"])
def test_cached_drafter_is_bit_identical_and_skips_the_float_model(target_dir, tmp_path, cache, builds, head_dtype):
    spec = _spec(target_dir, _delta(tmp_path / "d", head_dtype=head_dtype))
    fresh = load_model(spec)
    assert len(builds) == 1 and len(_entries(cache)) == 1
    warm = load_model(spec)
    assert len(builds) == 1                                  # read back, not built again
    assert isinstance(warm.model.layers[0].qkv, lean_drafter.Int4Linear)  # the int4 weights came back as int4
    assert type(warm.model.head) is type(fresh.model.head)    # and the head as it was built
    assert isinstance(warm.model.head, lean_drafter.HalfHead) == (head_dtype == "float16")
    assert warm.model.int4_exact_fraction == fresh.model.int4_exact_fraction
    assert warm.name == fresh.name
    assert modeling.vocab_fingerprint(warm.tokenizer) == modeling.vocab_fingerprint(fresh.tokenizer)
    assert torch.equal(_logits(warm), _logits(fresh))


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_cache_is_rebuilt(target_dir, tmp_path, cache, builds, damage):
    spec = _spec(target_dir, _delta(tmp_path / "d"))
    fresh = _logits(load_model(spec))
    (entry,) = _entries(cache)
    weights = entry / PREBUILT_WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "flip":             # same size, one bit off in the middle of the tensors
        data[len(data) // 2] ^= 0x10
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (entry / PREBUILT_MANIFEST).write_text("{not json")
    rebuilt = load_model(spec)
    assert len(builds) == 2
    assert torch.equal(_logits(rebuilt), fresh)
    assert torch.equal(_logits(load_model(spec)), fresh) and len(builds) == 2  # the rebuilt entry is used


def test_another_recipe_or_source_gets_its_own_entry(target_dir, tmp_path, cache, builds):
    load_model(_spec(target_dir, _delta(tmp_path / "a")))
    load_model(_spec(target_dir, _delta(tmp_path / "b", draft_len=3)))
    assert len(builds) == 2 and len(_entries(cache)) == 2
    other = make_model(tmp_path / "other", VOCAB, seed=6, hidden=32, layers=2)
    load_model(_spec(other, tmp_path / "a"))
    assert len(builds) == 3 and len(_entries(cache)) == 3


def test_no_cache_unless_the_delta_asks(target_dir, tmp_path, cache, builds):
    spec = _spec(target_dir, _delta(tmp_path / "d", **{PREBUILT_FLAG: False}))
    load_model(spec)
    load_model(spec)
    assert len(builds) == 2 and not cache.exists()
