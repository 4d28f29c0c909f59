"""Structured outputs through the device daemon with the real `openai` client: ``chat.completions.parse``
with a pydantic model, ``response_format`` json_object / json_schema, the ``specdec.grammar`` extension
(regex, Lark), and the engine's own message for a grammar it refuses. A byte-level tiny pair (any text
is some sequence of its tokens), a live edge and daemon on loopback."""
from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from specdec.common.adjust import NO_ADJUST
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.modeling import chat_ids, encode_prompt
from specdec.device.metrics import DeviceMetrics
from specdec.device.tools import call_grammar, parse_calls, parse_tools, with_tools
from specdec.edge.metrics import EdgeMetrics
from tests.integration.test_daemon import MODEL, LoopThread, Stack, _post
from tests.support import reference_law
from tests.support.harness import load

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
MAX_TOKENS = 48


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=5)
    n: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def byte_chat_pair(byte_pair, tmp_path_factory):
    from transformers import AutoTokenizer
    target, drafter = byte_pair
    path = tmp_path_factory.mktemp("bytechat") / "draft"
    tok = AutoTokenizer.from_pretrained(drafter)
    tok.chat_template = CHAT_TEMPLATE
    load(str(drafter)).model.save_pretrained(path)
    tok.save_pretrained(path)
    return target, path


@pytest.fixture(scope="module")
def stack(byte_chat_pair):
    target, drafter = byte_chat_pair
    st = Stack(LoopThread(), contextlib.AsyncExitStack(), str(drafter), EdgeMetrics(), DeviceMetrics())
    st.edge = st.start_edge(target, metrics=st.edge_metrics)
    st.url = st.start_daemon(st.edge, metrics=st.device_metrics, device_kw=dict(max_new_tokens=MAX_TOKENS))
    yield st
    st.lt.call(st.exits.aclose())
    st.lt.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="anything", max_retries=0, timeout=60)


def _expected(pair, messages, grammar: Grammar) -> str:
    """The target alone under the grammar (greedy), through the same chat template."""
    target, tok = load(str(pair[0])), load(str(pair[1])).tokenizer
    ids = reference_law.greedy(target, chat_ids(tok, messages), MAX_TOKENS, NO_ADJUST, grammar)
    return tok.decode(ids, skip_special_tokens=True)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client, byte_chat_pair) -> None:
    messages = [{"role": "user", "content": "an item?"}]
    seen = []
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Item, max_tokens=MAX_TOKENS,
                                          temperature=1.0, seed=seed)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(r.choices[0].message.parsed, Item)
            seen.append(r.choices[0].message.parsed)
    assert seen, "no sample finished within max_tokens"
    schema = Item.model_json_schema()
    greedy = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Item,
                                           max_tokens=MAX_TOKENS, temperature=0)
    sent = openai.lib._pydantic.to_strict_json_schema(Item)
    assert greedy.choices[0].message.content == _expected(byte_chat_pair, messages,
                                                          Grammar(GrammarKind.JSON_SCHEMA, json.dumps(sent)))
    assert schema["properties"]["n"]["maximum"] == 99


def test_json_schema_samples_are_valid(client) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}},
              "required": ["k", "v"], "additionalProperties": False}
    finished = 0
    for seed in range(8):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], seed=seed,
                                           max_tokens=MAX_TOKENS, temperature=1.0, response_format={
                                               "type": "json_schema",
                                               "json_schema": {"name": "kv", "schema": schema, "strict": True}})
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            finished += 1
    assert finished >= 4, finished


def test_json_object_is_an_object(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "obj"}], temperature=0,
                                       max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("grammar, pattern", [
    ({"regex": "[ab]{2,5}c"}, r"[ab]{2,5}c"),
    ({"lark": 'start: "x" NUM "y"\nNUM: /[0-9]{1,3}/'}, r"x[0-9]{1,3}y"),
])
def test_the_extensions_regex_and_lark_grammars(client, grammar, pattern) -> None:
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="go: ", max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                      stream=stream, extra_body={"specdec": {"grammar": grammar, "mode": "tslt"}})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, "grammar"),
    ({"specdec": {"grammar": {"regex": "(unclosed"}}}, "grammar"),
    ({"specdec": {"grammar": {"lark": "start: undefined_rule"}}}, "grammar"),
    ({"specdec": {"grammar": {"regex": "a" * 70000}}}, "exceeds"),
    ({"specdec": {"grammar": {"ebnf": "x"}}}, "one of"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "specdec": {"grammar": {"regex": "a"}}}, "both set"),
])
def test_a_grammar_the_engine_refuses_is_a_400_with_its_message(stack, body, needle) -> None:
    status, payload = _post(stack.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert status == 400, payload
    assert needle in payload["error"]["message"], payload
    # and the daemon still serves
    status, ok = _post(stack.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, ok


def test_encode_prompt_is_byte_level(byte_chat_pair) -> None:
    tok = load(str(byte_chat_pair[1])).tokenizer
    assert tok.decode(encode_prompt(tok, "{\"a\": 1}", raw=True)) == "{\"a\": 1}"


# -- tools ---------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]
TOOL_TOKENS = 128  # a byte a token: a call with its markup is ~75


def test_a_named_tool_call_round_trip(client, byte_chat_pair) -> None:
    """A named function: the answer is a call of it whose arguments match its schema (the grammar
    makes sure), equal to the target alone under the same grammar and prompt; the tool's result goes
    back and the next answer is text."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=TOOL_TOKENS, tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    tools = parse_tools([WEATHER, TIME])
    target, tok = load(str(byte_chat_pair[0])), load(str(byte_chat_pair[1])).tokenizer
    expected = reference_law.greedy(target, chat_ids(tok, with_tools(ASK, tools, False)), TOOL_TOKENS, NO_ADJUST,
                                    call_grammar(tools, "get_weather"))
    text, calls = parse_calls(tok.decode(expected, skip_special_tokens=True))
    assert calls and calls[0]["function"]["arguments"] == call.function.arguments and not text
    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason in ("stop", "length")


def test_required_calls_one_of_the_tools_every_time(client) -> None:
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=TOOL_TOKENS)
        if r.choices[0].finish_reason == "length":
            continue
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])


def test_a_streamed_tool_call_arrives_as_a_delta(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True, temperature=0,
                                            max_tokens=TOOL_TOKENS, tool_choice={"type": "function",
                                                                                "function": {"name": "get_weather"}})
    chunks = list(stream)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    json.loads(deltas[0][0].function.arguments)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls"),
    ("/v1/completions", {"prompt": "x", "tools": [WEATHER]}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(stack, path, body, param) -> None:
    status, payload = _post(stack.url, path, {"max_tokens": 4, **body})
    assert status == 400 and payload["error"]["param"] == param, payload
