"""The device daemon's OpenAI-compatible API with the real `openai` client, a live daemon and a live
edge on loopback (tiny models): chat and completion, streaming and not, greedy identity with the
target alone, n > 1, stop strings, a cancelled stream freeing its edge session, 400s and 503s.

Edge and daemon run in one background event loop (the product's in-process entry points on real
ports); the tests talk to them over HTTP from the test thread as any application would.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest
import torch

from specdec.testbed import tiny_models
from tests.support.harness import VENV_BIN, edge, load, run_main, target_greedy
from tests.support import reference_law
from tests.support.raw_stream import RawSession
from specdec.common.adjust import LogitAdjust
from specdec.common.modeling import ModelSpec, encode_prompt
from specdec.device import cli as device_main
from specdec.device import openai_schema
from specdec.device.client import EdgeError
from specdec.device.daemon import DaemonConfig, edge_api_error, start_daemon
from specdec.device.metrics import DeviceMetrics
from specdec.device.factory import DeviceConfig
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.admission import AdmissionSettings
from specdec.edge.verifier import EdgeLimits

MODEL = "specdec-test"
PROMPT = "w5 w6 w7"
MAX_TOKENS = 12
# Renders each message as its words after a marker word, so prompts go through a real chat template.
CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")
LONG_CONTEXT = 2048     # room for a stream long enough to be cancelled mid-way
LONG_MAX_TOKENS = 1500
CANCEL_ATTEMPTS = 3
WAIT_S = 15.0


class LoopThread:
    """An event loop in a background thread, running the edge and the daemon for the whole module."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """Target and drafter (512 words, 2048 positions); the drafter's tokenizer has a chat template."""
    target, drafter = tiny_models.make_pair(tmp_path_factory.mktemp("daemon"), 512, logit_scale=2.0,
                                            max_positions=LONG_CONTEXT)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(drafter)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(drafter)
    return target, drafter


@dataclass
class Stack:
    lt: LoopThread
    exits: contextlib.AsyncExitStack   # everything started in the loop, stopped in reverse order
    drafter: str
    edge_metrics: EdgeMetrics
    device_metrics: DeviceMetrics
    edge: str = ""          # the edge's HOST:PORT
    url: str = ""           # the daemon's base URL

    def start_edge(self, target, **kw) -> str:
        return self.lt.call(self.exits.enter_async_context(edge(target, **kw)))

    def start_daemon(self, edge_address: str, connect_timeout: float = 2.0, device_kw=None, **kw) -> str:
        device = DeviceConfig.of(**{"edge": edge_address, "draft_model": self.drafter, "draft_len": 3,
                                    "temperature": 1.0, "max_new_tokens": 16, "timeout": 60.0, **(device_kw or {})})
        cfg = DaemonConfig(device=device, port=0, model_name=MODEL, connect_timeout=connect_timeout)
        daemon = self.lt.call(start_daemon(cfg, drafter=load(self.drafter), **kw))
        self.exits.push_async_callback(daemon.stop)
        return f"http://127.0.0.1:{daemon.port}"


@pytest.fixture(scope="module")
def stack(chat_pair) -> Stack:
    target, drafter = chat_pair
    st = Stack(LoopThread(), contextlib.AsyncExitStack(), str(drafter), EdgeMetrics(), DeviceMetrics())
    st.edge = st.start_edge(target, metrics=st.edge_metrics)
    st.url = st.start_daemon(st.edge, metrics=st.device_metrics)
    yield st
    st.lt.call(st.exits.aclose())
    st.lt.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="anything", max_retries=0, timeout=60)


def _greedy(chat_pair, prompt_ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    return target_greedy(chat_pair[0], prompt_ids, n)


def _tok(chat_pair):
    return load(str(chat_pair[1])).tokenizer


def _text(chat_pair, ids: list[int]) -> str:
    return _tok(chat_pair).decode(ids, skip_special_tokens=True)


def _post(base: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict | str]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


def _get(base: str, path: str) -> tuple[int, str]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    return resp.status, body


def _wait_for(predicate, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- pure pieces -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, stops, expected", [
    ("hello wor", ("world",), len("hello ")),   # "wor" may still become "world"
    ("hello", ("xyz",), 5),
    ("ab", ("abc", "b"), 0),                     # "ab" is a prefix of "abc"
    ("", ("a",), 0),
])
def test_safe_length_holds_back_possible_stop_prefixes(text, stops, expected) -> None:
    assert openai_schema.safe_length(text, stops) == expected


def test_find_stop_returns_the_earliest_stop() -> None:
    assert openai_schema.find_stop("one two three", ("three", "two")) == 4
    assert openai_schema.find_stop("one", ("x",)) == -1


def test_overrides_map_to_device_config_fields_and_refuse_unknowns() -> None:
    out = openai_schema.parse_overrides({"mode": "ksqs", "top_k": 8, "alpha": 0.1, "draft_len": 2})
    assert out["mode"].value == "ksqs" and out["top_k"] == 8 and out["csqs_alpha"] == 0.1
    assert openai_schema.parse_overrides({"tree": [2, 1]})["tree"] == (2, 1)
    for bad in ({"nope": 1}, {"mode": "zip"}, {"top_k": 0}, {"top_k": 2.5}, {"draft_len": True}, [1],
                {"tree": [2, 0]}, {"tree": "2,2"}):
        with pytest.raises(openai_schema.ApiError) as err:
            openai_schema.parse_overrides(bad)
        assert err.value.status == 400


# -- the API through the real openai client ---------------------------------------------------------
def test_models_lists_the_served_model(client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("overrides", [
    {"mode": "tslt", "top_k": 32}, {"mode": "ksqs", "top_k": 32, "lattice": 100}, {"mode": "dssd"},
    {"mode": "tslt", "top_k": 16, "tree": [2, 2, 1]},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_completion_greedy_equals_target_alone(client, chat_pair, overrides) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"specdec": overrides})
    prompt_ids = encode_prompt(_tok(chat_pair), PROMPT, raw=True)
    expected = _greedy(chat_pair, prompt_ids)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.model_extra["specdec"]["token_ids"] == expected
    assert choice.text == _text(chat_pair, expected)
    assert choice.finish_reason == ("stop" if expected[-1] == tiny_models.EOS_ID else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(expected))
    assert r.usage.total_tokens == len(prompt_ids) + len(expected)


def test_ignore_eos_goes_on_to_max_tokens_past_an_eos(client) -> None:
    """vLLM's ignore_eos: an EOS that a logit bias puts on top ends the plain request at its first token;
    with the flag the answer goes on to max_tokens, each token that EOS (the biased law's greedy choice
    at every position), and ends with `length`."""
    bias = {str(tiny_models.EOS_ID): 100}
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias)
    on = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias,
                                   extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == MAX_TOKENS
    assert on.choices[0].model_extra["specdec"]["token_ids"] == [tiny_models.EOS_ID] * MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_bias_and_penalties_shape_the_target_law(client, chat_pair, stream) -> None:
    """OpenAI's logit_bias, presence and frequency penalties, and vLLM's repetition_penalty and min_p
    (extra_body), through the real client: the output is ``generate``'s with transformers' own
    processors (tests/support/reference_law.py), and differs from the plain greedy decode."""
    prompt_ids = encode_prompt(_tok(chat_pair), PROMPT, raw=True)
    plain = _greedy(chat_pair, prompt_ids)
    bias = {plain[0]: -100.0, plain[2]: 3.0}
    adjust = LogitAdjust.of(bias, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    expected = reference_law.greedy(load(str(chat_pair[0])), prompt_ids, MAX_TOKENS, adjust)
    assert expected != plain
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  logit_bias={str(k): v for k, v in bias.items()}, presence_penalty=0.5,
                                  frequency_penalty=0.3, stream=stream,
                                  extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "specdec": {"mode": "tslt"}})
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == _text(chat_pair, expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_targets_at_every_token(client, chat_pair, stream) -> None:
    """OpenAI's chat logprobs (each token's own and the top 3), equal to transformers' log-softmax of
    the target at that position (T = 0: temperature 1, as OpenAI reports a greedy answer's)."""
    messages = [{"role": "user", "content": "w5 w6"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3, stream=stream,
                                       extra_body={"specdec": {"mode": "tslt"}})
    if stream:
        chunks = list(r)
        content = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
        text = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
    else:
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    prompt_ids = _tok(chat_pair).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    expected = _greedy(chat_pair, prompt_ids)
    target, tok = load(str(chat_pair[0])), _tok(chat_pair)
    assert [c.token for c in content] == [tok.decode([t]) for t in expected] and text == _text(chat_pair, expected)
    for i, c in enumerate(content):
        law = reference_law.next_probs(target, tuple(prompt_ids), tuple(expected[:i]), LogitAdjust(), 1.0)
        assert abs(c.logprob - math.log(law[expected[i]])) < 1e-4, i
        top = torch.topk(law, 3)
        assert [t.token for t in c.top_logprobs] == [tok.decode([t]) for t in top.indices.tolist()], i
        assert all(abs(t.logprob - math.log(p)) < 1e-4 for t, p in zip(c.top_logprobs, top.values.tolist()))


def test_completion_logprobs_in_the_legacy_shape(client, chat_pair) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.7, seed=3,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    ids = r.choices[0].model_extra["specdec"]["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_auto_tools_still_stream_an_answer_that_is_text(client) -> None:
    """tool_choice auto: a text answer streams in pieces as without tools, the same text as whole
    (a call's text would be held back: tests/unit/test_tools.py)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], tools=[tool], temperature=0,
              max_tokens=MAX_TOKENS, tool_choice="auto")
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kw)
              if c.choices and c.choices[0].delta.content]
    assert whole.message.tool_calls is None and "".join(chunks).strip() == whole.message.content
    assert len(chunks) > 1, chunks


def test_chat_greedy_goes_through_the_template_and_equals_target_alone(client, chat_pair) -> None:
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    prompt_ids = _tok(chat_pair).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    assert prompt_ids == encode_prompt(_tok(chat_pair), "w2 w9 w2 w5 w6 w3", raw=True)  # the template ran
    expected = _greedy(chat_pair, prompt_ids)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _text(chat_pair, expected)
    assert r.choices[0].model_extra["specdec"]["token_ids"] == expected
    assert r.usage.prompt_tokens == len(prompt_ids)


def test_streamed_chat_arrives_in_chunks_and_equals_greedy(client, chat_pair) -> None:
    messages = [{"role": "user", "content": "w5 w6"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # verified tokens are sent per round, not as one block at the end
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    prompt_ids = encode_prompt(_tok(chat_pair), "w2 w5 w6 w3", raw=True)
    assert "".join(content) == _text(chat_pair, _greedy(chat_pair, prompt_ids))


def test_streamed_completion_ends_with_done_event(stack, chat_pair) -> None:
    status, body = _post(stack.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    expected = _greedy(chat_pair, encode_prompt(_tok(chat_pair), PROMPT, raw=True))
    assert text == _text(chat_pair, expected)


def test_n_choices_are_indexed_independent_seeded_sessions(client, stack) -> None:
    started = stack.edge_metrics.registry.get_sample_value("specdec_edge_sessions_started_total", {"mode": "tslt"}) or 0
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=11)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # each choice its own seed (10 tokens at T=1)
    assert a.usage.completion_tokens == sum(len(c.model_extra["specdec"]["token_ids"]) for c in a.choices)
    after = stack.edge_metrics.registry.get_sample_value("specdec_edge_sessions_started_total", {"mode": "tslt"})
    assert after - started == 6
    streamed = client.completions.create(**kw, stream=True)
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]


def test_concurrent_requests_each_get_their_own_session(client, chat_pair) -> None:
    expected = _text(chat_pair, _greedy(chat_pair, encode_prompt(_tok(chat_pair), PROMPT, raw=True)))

    def one(mode: str) -> str:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"specdec": {"mode": mode}})
        return r.choices[0].text

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(one, ["tslt", "dense", "csqs"])) == [expected] * 3


def test_stop_string_ends_the_session_and_is_not_emitted(client, chat_pair) -> None:
    full_ids = _greedy(chat_pair, encode_prompt(_tok(chat_pair), PROMPT, raw=True))
    full = _text(chat_pair, full_ids)
    stop = full.split()[4]
    want = full[:openai_schema.find_stop(full, (stop,))]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(full_ids)  # it stopped, rather than trimming a finished text
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_cancelled_stream_frees_its_edge_session(stack) -> None:
    gauge = lambda: stack.edge_metrics.registry.get_sample_value("specdec_edge_sessions_active")  # noqa: E731
    cancelled = lambda: stack.device_metrics.registry.get_sample_value(  # noqa: E731
        "specdec_device_sessions_ended_total", {"status": "cancelled"}) or 0
    # A sampled answer may reach EOS in the instant between the first chunk and the hang-up; then
    # nothing was cancelled and another sample is tried.
    for _attempt in range(CANCEL_ATTEMPTS):
        before = cancelled()
        assert _wait_for(lambda: gauge() == 0)
        conn, resp = _open_stream(stack.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_MAX_TOKENS,
                                              "temperature": 1.0, "stream": True, "specdec": {"draft_len": 1}})
        assert resp.readline().startswith(b"data: ")
        assert gauge() == 1  # the session is open on the edge while the stream runs
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert _wait_for(lambda: gauge() == 0), "the edge session outlived its client"
        if _wait_for(lambda: cancelled() == before + 1, timeout=3.0):
            return
    pytest.fail(f"no stream was still running when its client left, in {CANCEL_ATTEMPTS} attempts")


def _open_stream(base: str, body: dict):
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "specdec": {"mode": "dssd"}}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"w5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": "high"}, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]},
     "modalities"),
    ("/v1/completions", {"prompt": PROMPT, "specdec": {"nope": 1}}, "specdec.nope"),
    ("/v1/completions", {"prompt": PROMPT, "specdec": {"mode": "zip"}}, "specdec.mode"),
    ("/v1/completions", {"prompt": PROMPT, "specdec": {"draft_len": 0}}, "specdec.draft_len"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True,
                              "response_format": {"type": "json_object"}}, "ignore_eos"),
    ("/v1/chat/completions", [1, 2], None),
])
def test_malformed_requests_get_400_in_openai_error_shape(stack, path, body, param) -> None:
    status, payload = _post(stack.url, path, body)
    assert status == 400, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]
    assert payload["error"]["param"] == param


def test_invalid_json_and_unknown_routes_answer_in_openai_shape(stack, client) -> None:
    status, payload = _post(stack.url, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    status, payload = _post(stack.url, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "error" in payload
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"specdec": {"top_k": "many"}})
    assert err.value.status_code == 400 and "top_k" in err.value.message


def _chat_once(client_: openai.OpenAI) -> str:
    r = client_.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=4)
    return r.choices[0].message.content


def test_unreachable_edge_answers_503_quickly_then_serves_once_the_edge_is_back(stack, chat_pair) -> None:
    port = _closed_port()
    url = stack.start_daemon(f"127.0.0.1:{port}", connect_timeout=1.0)
    offline = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        _chat_once(offline)
    assert time.monotonic() - t0 < 5.0
    assert err.value.status_code == 503
    assert err.value.body["type"] == "server_error" and "unreachable" in err.value.body["message"]
    assert _get(url, "/health")[0] == 503
    # The edge comes up on that address: the same daemon and channel reconnect by themselves.
    stack.lt.call(_edge_on_port(stack, chat_pair[0], port))
    assert _wait_for(lambda: _answers(offline)), "the daemon did not reconnect to the edge"
    assert _get(url, "/health")[0] == 200


async def _edge_on_port(stack, target, port: int) -> None:
    cfg = EdgeConfig(model=ModelSpec(model=str(target)), host="127.0.0.1", port=port, workers=1)
    server, _ = await start_server(cfg, load(str(target)))
    stack.exits.push_async_callback(stop_server, server, 0)


def _answers(client_: openai.OpenAI) -> bool:
    try:
        return isinstance(_chat_once(client_), str)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503
        return False


def test_context_filling_up_ends_the_answer_with_length(stack, chat_pair) -> None:
    limit = 32
    url = stack.start_daemon(stack.start_edge(chat_pair[0], limits=EdgeLimits(max_context=limit)))
    prompt_ids = encode_prompt(_tok(chat_pair), PROMPT, raw=True)
    assert tiny_models.EOS_ID not in _greedy(chat_pair, prompt_ids, limit), "fixture: greedy must not end early"
    cli = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = cli.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2 * limit, temperature=0)
    assert r.choices[0].finish_reason == "length"
    n = r.usage.completion_tokens
    assert limit - len(prompt_ids) - 8 < n < limit - len(prompt_ids)  # within one round of the limit
    assert r.choices[0].model_extra["specdec"]["token_ids"] == _greedy(chat_pair, prompt_ids, n)


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.OUT_OF_RANGE, 400, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "server_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 502, "server_error"),     # the daemon's credentials, not the client's
    (grpc.StatusCode.PERMISSION_DENIED, 502, "server_error"),
    (grpc.StatusCode.INTERNAL, 502, "server_error"),
])
def test_edge_statuses_map_to_http(code, status, kind) -> None:
    err = edge_api_error(EdgeError(code, "why"))
    assert (err.status, err.type, err.code) == (status, kind, code.name.lower())
    assert err.message == f"edge: {code.name}: why"


def test_an_edge_refusing_the_daemons_token_is_a_502_naming_it(stack, chat_pair, tmp_path) -> None:
    (tmp_path / "edge.tokens").write_text("right\n")
    (tmp_path / "daemon.token").write_text("wrong\n")
    edge_address = stack.start_edge(chat_pair[0], auth_token_file=str(tmp_path / "edge.tokens"))
    url = stack.start_daemon(edge_address, device_kw={"auth_token_file": str(tmp_path / "daemon.token")})
    status, body = _post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert status == 502 and body["error"]["code"] == "unauthenticated", body
    assert body["error"]["message"].startswith("edge: UNAUTHENTICATED:")


def test_a_full_edge_is_a_503_naming_the_limit(stack, chat_pair) -> None:
    edge_address = stack.start_edge(chat_pair[0], limits=EdgeLimits(max_sessions=1),
                                    admission=AdmissionSettings(max_sessions_per_principal=0, queue=0))
    url = stack.start_daemon(edge_address)
    async def open_holder():  # the channel is made in the loop that runs it
        return await RawSession(edge_address, load(stack.drafter)).open()

    holder = stack.lt.call(open_holder())  # holds the only slot
    try:
        status, body = _post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    finally:
        stack.lt.call(holder.close())
    assert status == 503 and body["error"]["code"] == "resource_exhausted", body
    assert "limit of 1 session" in body["error"]["message"]


# -- the command -----------------------------------------------------------------------------------
def test_serve_command_answers_exports_metrics_and_stops_on_sigterm(stack, chat_pair) -> None:
    metrics_port = _closed_port()
    proc = subprocess.Popen(
        [str(VENV_BIN / "device-client"), "serve", "--edge", stack.edge, "--listen", "127.0.0.1:0",
         "--draft-model", str(chat_pair[1]), "--threads", "1", "--served-model-name", "m1",
         "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        port = _ready_port(proc)
        cli = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in cli.models.list().data] == ["m1"]
        r = cli.completions.create(model="m1", prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.choices[0].text
        status, body = _get(f"http://127.0.0.1:{metrics_port}", "/metrics")
        # a request without draft settings runs mode auto (factory.AUTO_BY_DEFAULT)
        assert status == 200 and 'specdec_device_sessions_started_total{mode="auto"} 1.0' in body
        assert 'specdec_device_http_requests_total{route="/v1/completions",status="200"} 1.0' in body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_serve_bad_flag_exits_nonzero_with_one_line(capsys) -> None:
    """The command's own main in this process: the serve process above and test_cli's bad-flag process
    show the status and the line reaching the shell."""
    rc, err = run_main(device_main.main, ["serve", "--edge", "127.0.0.1:1", "--listen", "nope"], capsys)
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1 and "--listen" in lines[0], err


def _ready_port(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("device-client serve exited:\n" + "".join(lines))
        lines.append(line)
        m = re.search(r"ready on http://[\d.]+:(\d+)", line)
        if m:
            return int(m.group(1))
    raise TimeoutError("daemon not ready:\n" + "".join(lines))
