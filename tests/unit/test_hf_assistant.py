"""LeanAssistant (device/hf_assistant.py): the default drafter's module accepted by transformers'
``generate(assistant_model=...)``, on a tiny random Llama loaded through the same delta path as the
committed drafter (int4 layers, reduced head).

- Assisted generation with it at T = 0 equals the target's own greedy output, and really used it
  (the assistant ran, and the target needed fewer forwards than it generated tokens).
- Wrapping leaves the drafter's weights as they were (PreTrainedModel.post_init would re-initialise
  them), and its own greedy ``generate`` equals greedy decoding through LeanDrafter + CachedLM (same
  logits, transformers' cache handling included).
"""
from __future__ import annotations


import pytest
import torch

from specdec.common.modeling import CachedLM, ModelSpec, load_model
from specdec.device import lean_drafter
from specdec.device.hf_assistant import LeanAssistant, as_assistant
from specdec.testbed.tiny_models import make_model

VOCAB = 64
PROMPT = [5, 9, 2, 33, 17, 8]
NEW_TOKENS = 24
DRAFT_LEN = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant")
    target_dir = make_model(root / "target", VOCAB, seed=3, hidden=32, layers=2)
    delta = root / "delta"
    lean_drafter.save_drafter(delta, torch.arange(0, VOCAB - 8), {"name": "tiny", "num_layers": 2, "int4": True})
    target = load_model(ModelSpec(model=str(target_dir)))
    drafter = load_model(ModelSpec(model=str(target_dir), delta=str(delta), builder=lean_drafter.DELTA_BUILDER))
    assert isinstance(drafter.model.layers[0].qkv, lean_drafter.Int4Linear)
    return target, drafter


def _greedy_kwargs() -> dict:
    # no EOS: both runs generate exactly NEW_TOKENS tokens
    return dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                pad_token_id=0)


def _count_calls(module: torch.nn.Module) -> list:
    calls = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_assisted_generation_equals_target_greedy(models):
    target, drafter = models
    assistant = as_assistant(drafter)
    assert isinstance(assistant.model, LeanAssistant) and assistant.model.lean is drafter.model
    gc = assistant.model.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = DRAFT_LEN, "constant", 0.0
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        greedy = target.model.generate(ids, attention_mask=torch.ones_like(ids), **_greedy_kwargs())
        drafts, verifies = _count_calls(drafter.model), _count_calls(target.model)
        assisted = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant.model,
                                         **_greedy_kwargs())
    assert assisted.tolist() == greedy.tolist()
    assert len(drafts) > 0 and len(verifies) < NEW_TOKENS  # drafts were made and accepted


def test_assistant_generate_is_lean_drafter_greedy(models):
    _, drafter = models
    before = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    assistant = LeanAssistant(drafter.model)
    after = drafter.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # wrapping never re-initialises weights
    with torch.inference_mode():
        out = assistant.generate(torch.tensor([PROMPT]), **_greedy_kwargs())[0, len(PROMPT):].tolist()
    lm, expected = CachedLM(drafter.model, drafter.device), []
    logits = lm.forward(PROMPT, num_logits=1)
    for _ in range(NEW_TOKENS):
        expected.append(int(logits[-1].argmax()))
        logits = lm.forward([expected[-1]], num_logits=1)
    assert out == expected
    assert set(out) <= set(drafter.model.keep_ids.tolist())  # q = 0 off the head: never drafted


def test_refuses_padding(models):
    _, drafter = models
    with pytest.raises(ValueError, match="unpadded"):
        LeanAssistant(drafter.model)(torch.tensor([PROMPT]), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
