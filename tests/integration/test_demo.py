"""`make demo` end to end on tiny models: edge subprocess, device in process, target alone, summary."""
from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.harness import VENV_BIN


def _demo(tiny_pair, *extra: str) -> subprocess.CompletedProcess:
    target, drafter = tiny_pair
    cmd = [str(VENV_BIN / "python"), "-m", "specdec.device.demo", "--target-model", str(target),
           "--draft-model", str(drafter), "--raw", "--prompt", "w5 w6 w7", "--max-new-tokens", "12", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def demos(tiny_pair_v512) -> dict[str, subprocess.CompletedProcess]:
    """Both runs side by side: each is a demo process with an edge-server process of its own, mostly
    imports and model loading on one core, so the two overlap on CI's two cores."""
    with ThreadPoolExecutor(2) as pool:
        text = pool.submit(_demo, tiny_pair_v512)
        record = pool.submit(_demo, tiny_pair_v512, "--json", "--mode", "dense")
        return {"text": text.result(), "json": record.result()}


def test_demo_prints_prompt_answer_and_summary(demos) -> None:
    r = demos["text"]
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("prompt: w5 w6 w7\nanswer: w")
    for label in ("pair (edge + device):", "target alone:", "speedup:", "acceptance:", "uplink:"):
        assert label in out, out
    assert "same tokens as the target alone" in out  # greedy by default: lossless


def test_demo_json_keeps_the_full_record(demos) -> None:
    r = demos["json"]
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record["prompt"] == "w5 w6 w7" and record["mode"] == "dense"
    assert record["token_ids"] == record["target_alone"]["token_ids"]
    assert record["stats"]["generated_tokens"] == 12 and record["stats"]["uplink_bytes"] > 0
    assert any(line.startswith("speedup:") for line in record["summary"])
