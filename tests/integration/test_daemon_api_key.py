"""The device daemon's API key (issue 34): every endpoint but /health wants it, answered 401 in
OpenAI's shape otherwise (the real `openai` client raises AuthenticationError); listening beyond
loopback without a key is refused by the command, or allowed explicitly with a loud warning."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import urllib.error
import urllib.request

import openai
import pytest

from specdec.device.daemon import DaemonConfig, ExposureError, start_daemon
from tests.support.harness import VENV_BIN, device_config, edge, load, run, target_greedy
from specdec.common.modeling import encode_prompt
from specdec.testbed import procs

KEY = "sk-specdec-test-key"
PROMPT = "w5 w6 w7"
MAX_TOKENS = 6


def _request(port: int, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            text = r.read().decode()
            return r.status, dict(r.headers), json.loads(text) if text.startswith("{") else {"text": text}
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read().decode())


def test_every_endpoint_but_health_wants_the_key(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    completion = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}

    async def main():
        async with edge(target_dir) as address:
            cfg = DaemonConfig(device=device_config(edge=address, draft_model=str(drafter_dir), mode="tslt",
                                                    top_k=16), port=0, api_key=KEY)
            daemon = await start_daemon(cfg, drafter=load(str(drafter_dir)))
            try:
                return await asyncio.to_thread(_calls, daemon.port, completion)
            finally:
                await daemon.stop()
    answers, with_client = run(main())
    for path, key in (("/v1/models", None), ("/v1/models", "wrong"), ("/metrics", None),
                      ("/v1/completions", ""), ("/v1/completions", "sk-specdec-test-ke")):
        status, headers, body = answers[path, key]
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (path, key, status)
        assert set(body["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    assert answers["/health", None][0] == 200
    assert answers["/v1/models", KEY][0] == 200 and answers["/metrics", KEY][0] == 200
    status, _, body = answers["/v1/completions", KEY]
    greedy = target_greedy(target_dir, encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True), MAX_TOKENS)
    assert status == 200 and body["choices"][0]["text"] == load(str(drafter_dir)).tokenizer.decode(
        greedy, skip_special_tokens=True)
    assert with_client == ("AuthenticationError", body["choices"][0]["text"])


def _calls(port: int, completion: dict):
    answers = {}
    for path, key in (("/v1/models", None), ("/v1/models", "wrong"), ("/v1/models", KEY), ("/metrics", None),
                      ("/metrics", KEY), ("/health", None)):
        answers[path, key] = _request(port, path, key)
    for key in ("", "sk-specdec-test-ke", KEY):  # an empty bearer, a prefix of the key, the key
        answers["/v1/completions", key] = _request(port, "/v1/completions", key, completion)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        refused = "accepted"
    except openai.AuthenticationError as e:
        refused = type(e).__name__
    text = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).completions.create(
        **completion).choices[0].text
    return answers, (refused, text)


def test_listening_beyond_loopback_without_a_key_is_refused_or_loudly_allowed(caplog) -> None:
    bare = DaemonConfig(device=device_config(edge="127.0.0.1:1"), host="0.0.0.0", port=0)
    with pytest.raises(ExposureError, match="without an API key"):
        run(start_daemon(bare))  # before any model is loaded or port opened
    result = subprocess.run([str(VENV_BIN / "device-client"), "serve", "--edge", "127.0.0.1:1", "--listen",
                             "0.0.0.0:0"], capture_output=True, text=True, timeout=120, env=procs.child_env())
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--api-key" in result.stderr and "--allow-no-api-key" in result.stderr
    from specdec.device.daemon import check_exposure
    with caplog.at_level(logging.WARNING, logger="specdec.device.daemon"):
        check_exposure(DaemonConfig(host="0.0.0.0", allow_no_api_key=True))
    assert "NO API KEY" in caplog.text
    check_exposure(DaemonConfig(host="0.0.0.0", api_key=KEY))  # a key: fine anywhere
    check_exposure(DaemonConfig(host="127.0.0.1"))             # loopback: fine without one


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from specdec.device import cli as cli
    (tmp_path / "key").write_text(f"# the daemon's key\n{KEY}\n")
    parse = cli.build_serve_parser().parse_args
    assert cli._api_key(parse(["--edge", "e:1", "--api-key-file", str(tmp_path / "key")])) == KEY
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli._api_key(parse(["--edge", "e:1"])) == "from-env"
    assert cli._api_key(parse(["--edge", "e:1", "--api-key", KEY])) == KEY
    assert repr(DaemonConfig(api_key=KEY)).count(KEY) == 0  # never printed
