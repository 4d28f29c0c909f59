"""OpenAI-compatible request parsing and response shapes for the device daemon (no sockets here).

Requests are plain JSON objects in, frozen dataclasses out; anything malformed or unsupported raises
:class:`ApiError` (HTTP 400 with OpenAI's error shape). Responses and stream chunks are built as
plain dicts matching the OpenAI API (``text_completion``, ``chat.completion``,
``chat.completion.chunk``), so the official clients parse them unchanged.

Lossless rule: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``logit_bias`` and the presence,
frequency and repetition penalties shape the TARGET distribution on the edge (common/sampling.TargetLaw),
so the output is distributed as the target sampling alone with those settings. Parameters this server
cannot honour yet (logprobs, tools, structured outputs) are refused rather than silently ignored
(docs/api.md lists every parameter).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.common.adjust import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY,
                                   NO_ADJUST, LogitAdjust)
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.logprobs import MAX_TOP_LOGPROBS, NO_LOGPROBS, TokenLogprob
from specdec.common.settings import canonical_name, check_value, setting_names
from specdec.device.tools import Tool, ToolError, call_grammar, parse_calls, parse_tool_choice, parse_tools

MAX_STOP_STRINGS = 4          # OpenAI's own limit on `stop`
MAX_CHOICES = 16              # prompts x n per request: each choice is its own edge session
MAX_TEMPERATURE = 2.0         # OpenAI's documented range is [0, 2]
MAX_SEED = 2**63 - 1          # the drafter's torch.Generator takes seeds below 2**63
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SPECDEC_FIELD = "specdec"     # the request's extension object: per-request draft/compression settings

# Parameters OpenAI defines that this server cannot honour losslessly, with the value that means "off".
_UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),  # deprecated by OpenAI for tools / tool_choice
    # outputs other than text, and controls the target has no law for (docs/api.md)
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# -- the `specdec` extension ------------------------------------------------------------------------
# Named like the one-shot CLI flags (`--top-k` -> "top_k") and checked by the same table
# (common/settings.py), older names included ("alpha" for "csqs_alpha"). Inside this object `top_p`
# is the TSLT draft nucleus (as `--top-p`); the request's own `top_p` is the target's.
def parse_overrides(raw: Any) -> dict[str, Any]:
    """``{"mode": "tslt", "top_k": 64}`` -> draft settings by table name; unknown keys or values -> 400."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad(f"`{SPECDEC_FIELD}` must be an object", SPECDEC_FIELD)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        param = f"{SPECDEC_FIELD}.{key}"
        try:
            name = canonical_name(key)
        except KeyError:
            raise bad(f"unknown `{SPECDEC_FIELD}` setting {key!r} (known: {', '.join(setting_names())})",
                      param) from None
        if name == "tree" and not isinstance(value, list):  # JSON has lists, not tuples
            raise bad(f"`{param}` must be a list of branching factors >= 1, e.g. [2, 2, 2]", param)
        try:
            out[name] = check_value(name, value)
        except ValueError as exc:
            raise bad(f"`{param}`: {exc}", param) from None
    return out


# -- scalar checks ---------------------------------------------------------------------------------
def _number(value: Any, param: str, kind: type, low=None, high=None, *, low_open: bool = False):
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise bad(f"`{param}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", param)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        rng = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise bad(f"`{param}` must be in {rng}, got {value!r}", param)
    return kind(value)


def _optional(body: dict, key: str, kind: type, low=None, high=None, *, low_open: bool = False):
    value = body.get(key)
    return None if value is None else _number(value, key, kind, low, high, low_open=low_open)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("`stop` must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"`stop` takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    for key, off in _UNSUPPORTED.items():
        if key in body and body[key] not in off:
            raise bad(f"`{key}` is not supported by the specdec device daemon", key)


def _grammar(body: dict) -> Grammar | None:
    """The grammar the output must match: OpenAI's ``response_format`` or the extension's
    ``specdec.grammar``, not both. Compiled (and refused with the engine's message) by the daemon."""
    fmt = _response_format(body.get("response_format"))
    ext = body.get(SPECDEC_FIELD, {}).get("grammar") if isinstance(body.get(SPECDEC_FIELD), dict) else None
    if ext is not None and fmt is not None:
        raise bad(f"`response_format` and `{SPECDEC_FIELD}.grammar` both set", "response_format")
    return fmt if ext is None else _extension_grammar(ext)


def _response_format(fmt: Any) -> Grammar | None:
    """``text`` (None), ``json_object``, or ``json_schema`` with its ``schema`` (``strict`` or not: the
    grammar holds the output to the schema either way)."""
    kinds = ("text", "json_object", "json_schema")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in kinds):
        raise bad("`response_format` is {\"type\": \"text\" | \"json_object\" | \"json_schema\"}", "response_format")
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("`response_format.json_schema` must be an object with a `schema` object", "response_format")
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(spec.get("schema", {})))


def _extension_grammar(ext: Any) -> Grammar:
    """``specdec.grammar``: ``{"regex": str}``, ``{"lark": str}`` or ``{"json_schema": object}``."""
    param = f"{SPECDEC_FIELD}.grammar"
    if not isinstance(ext, dict) or len(ext) != 1 or next(iter(ext)) not in ("regex", "lark", "json_schema"):
        raise bad(f"`{param}` is one of {{\"regex\": str}}, {{\"lark\": str}}, {{\"json_schema\": object}}", param)
    (key, value), = ext.items()
    if not isinstance(value, dict if key == "json_schema" else str):
        raise bad(f"`{param}.{key}` must be {'an object' if key == 'json_schema' else 'a string'}", param)
    return Grammar(GrammarKind(key), json.dumps(value) if key == "json_schema" else value)


# -- requests --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    model: str | None
    max_tokens: int | None          # None = the daemon's --max-new-tokens
    temperature: float | None       # None = the daemon's --temperature
    top_p: float | None             # target nucleus; None = off
    top_k: int | None               # target top-k (vLLM's extension); None = off
    min_p: float | None             # target min-p (vLLM's extension); None = off
    seed: int | None                # None = a fresh random seed per request
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool             # stream_options.include_usage: a final usage chunk
    overrides: dict = field(default_factory=dict)  # DeviceConfig field -> value (the `specdec` object)
    adjust: LogitAdjust = NO_ADJUST  # logit_bias and the penalties (token ids checked against the vocabulary later)
    grammar: Grammar | None = None   # response_format or specdec.grammar (compiled against the vocabulary later)
    logprobs: int = NO_LOGPROBS      # the tokens' log-probabilities (0) and the top N (N > 0)
    ignore_eos: bool | None = None   # vLLM's extension: on to max_tokens past EOS; None = the daemon's default


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]   # text, or token ids
    params: SamplingParams


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict, ...]      # {"role": str, "content": str, "tool_calls"?: [...]}
    params: SamplingParams
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"       # none | auto | required | a function's name (device/tools.py)


def _logprobs(body: dict, chat: bool) -> int:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs``); completions:
    ``logprobs`` (0..20: the top N with each token's own)."""
    if not chat:
        n = _optional(body, "logprobs", int, 0, MAX_TOP_LOGPROBS)
        return NO_LOGPROBS if n is None else n
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("`logprobs` must be a boolean", "logprobs")
    top = _optional(body, "top_logprobs", int, 0, MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise bad("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return (top or 0) if on else NO_LOGPROBS


def _params(body: dict, *, max_tokens_keys: tuple[str, ...], chat: bool) -> SamplingParams:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("`model` must be a string", "model")
    max_tokens = None
    for key in max_tokens_keys:  # chat: max_completion_tokens supersedes max_tokens
        max_tokens = _optional(body, key, int, 1) if max_tokens is None else max_tokens
    n = _optional(body, "n", int, 1, MAX_CHOICES) or 1
    best_of = _optional(body, "best_of", int, 1)
    if best_of is not None and best_of != n:
        raise bad("`best_of` other than `n` is not supported", "best_of")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("`stream` must be a boolean", "stream")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad("`ignore_eos` must be a boolean", "ignore_eos")
    grammar = _grammar(body)
    if ignore_eos and grammar is not None:
        raise bad("`ignore_eos` with a grammar (response_format): the output ends where the grammar's "
                  "language does", "ignore_eos")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("`stream_options` is an object and only allowed with `stream: true`", "stream_options")
    return SamplingParams(
        model=model, max_tokens=max_tokens,
        temperature=_optional(body, "temperature", float, 0.0, MAX_TEMPERATURE),
        top_p=_optional(body, "top_p", float, 0.0, 1.0, low_open=True),
        top_k=_optional(body, "top_k", int, -1),
        min_p=_optional(body, "min_p", float, 0.0, 1.0),
        adjust=_adjust(body), grammar=grammar, logprobs=_logprobs(body, chat), ignore_eos=ignore_eos,
        seed=_optional(body, "seed", int, 0, MAX_SEED),
        stop=_stop(body.get("stop")), n=n, stream=stream,
        include_usage=bool((options or {}).get("include_usage")),
        overrides=parse_overrides(_without_grammar(body.get(SPECDEC_FIELD))))


def _without_grammar(ext: Any) -> Any:
    """The extension object's draft settings (its ``grammar`` is the law's, read by :func:`_grammar`)."""
    return {k: v for k, v in ext.items() if k != "grammar"} if isinstance(ext, dict) else ext


def _adjust(body: dict) -> LogitAdjust:
    """``logit_bias`` (token id strings, as OpenAI's, to [-100, 100]) and the presence, frequency and
    (vLLM's extension) repetition penalties."""
    raw = body.get("logit_bias")
    if raw is not None and not isinstance(raw, dict):
        raise bad("`logit_bias` must be an object of token ids to numbers", "logit_bias")
    if raw and len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"`logit_bias` takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(raw)}", "logit_bias")
    bias = {}
    for key, value in (raw or {}).items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad(f"`logit_bias` keys are token ids, got {key!r}", "logit_bias")
        bias[int(key)] = _number(value, f"logit_bias.{key}", float, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    penalty = {k: _optional(body, k, float, -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY)
               for k in ("presence_penalty", "frequency_penalty")}
    repetition = _optional(body, "repetition_penalty", float, 0.0, MAX_REPETITION_PENALTY, low_open=True)
    return LogitAdjust.of(bias, repetition_penalty=1.0 if repetition is None else repetition,
                          **{k: v or 0.0 for k, v in penalty.items()})


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_completion(body: Any) -> CompletionRequest:
    """POST /v1/completions: ``prompt`` is a string, a list of strings, token ids, or lists of them."""
    body = _require_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad("`prompt` must be a string, a list of strings, a list of token ids, or a list of those",
                  "prompt")
    for key in ("tools", "tool_choice"):
        if body.get(key) is not None:
            raise bad(f"`{key}` belongs to /v1/chat/completions", key)
    params = _params(body, max_tokens_keys=("max_tokens",), chat=False)
    if len(prompts) * params.n > MAX_CHOICES:
        raise bad(f"prompts x n must be at most {MAX_CHOICES}", "n")
    return CompletionRequest(tuple(p if isinstance(p, str) else tuple(p) for p in prompts), params)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad("message content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: Any) -> ChatRequest:
    """POST /v1/chat/completions: ``messages`` with text content (an assistant's earlier ``tool_calls``
    too), ``tools`` and ``tool_choice`` (device/tools.py)."""
    body = _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(f"each message needs a `role` in {list(CHAT_ROLES)}", f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m, i), **_calls(m, i)})
    params = _params(body, max_tokens_keys=("max_completion_tokens", "max_tokens"), chat=True)
    try:
        tools = parse_tools(body.get("tools"))
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except ToolError as exc:
        raise bad(str(exc), exc.param) from None
    grammar = call_grammar(tools, choice)
    if grammar is not None and params.grammar is not None:
        raise bad("a required or named `tool_choice` and a `response_format` both set", "tool_choice")
    if grammar is not None:
        params = replace(params, grammar=grammar)
    return ChatRequest(tuple(out), params, tools, choice)


def _calls(m: dict, i: int) -> dict:
    """An assistant message's earlier ``tool_calls`` (checked: each a function with JSON arguments)."""
    calls = m.get("tool_calls")
    if calls is None:
        return {}
    ok = m["role"] == "assistant" and isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", "{}"), str) for c in calls)
    if ok:
        try:
            [json.loads(c["function"].get("arguments") or "{}") for c in calls]
        except ValueError:
            ok = False
    if not ok:
        raise bad("`tool_calls` belong to assistant messages: functions with JSON `arguments`",
                  f"messages[{i}].tool_calls")
    return {"tool_calls": calls}


# -- logprobs ------------------------------------------------------------------------------------
# What OpenAI answers for a token the law excludes: JSON has no -inf.
IMPOSSIBLE_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if value > IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB


def chat_logprobs(entries: list[tuple[int, TokenLogprob]], decode) -> dict:
    """``choices[i].logprobs`` of a chat completion: ``content``, one item per token (``decode``: id -> text)."""
    def item(token: int, lp: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}
    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]} for t, e in entries],
            "refusal": None}


def completion_logprobs(entries: list[tuple[int, TokenLogprob]], decode, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a (legacy) completion: parallel lists, ``text_offset`` from ``offset``."""
    texts = [decode(t) for t, _ in entries]
    offsets = [offset + sum(len(x) for x in texts[:k]) for k in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [_lp(e.logprob) for _, e in entries],
            "top_logprobs": [{decode(i): _lp(lp) for i, lp in e.top} for _, e in entries], "text_offset": offsets}


# -- responses -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str              # "stop" (EOS or a stop string) | "length"
    stats: dict                     # per-session speculative decoding stats (extension field)
    logprobs: dict | None = None    # in OpenAI's shape (chat_logprobs / completion_logprobs), if asked
    tool_calls: list | None = None  # the answer's calls in OpenAI's shape (finish_reason "tool_calls")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _extension(c: Choice) -> dict:
    return {SPECDEC_FIELD: {"token_ids": c.token_ids, **c.stats}}


def completion_response(rid: str, model: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                         **_extension(c)} for c in choices],
            "usage": usage(prompt_tokens, choices)}


def chat_response(rid: str, model: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "message": _message(c),
                         "logprobs": c.logprobs, "finish_reason": c.finish_reason, **_extension(c)} for c in choices],
            "usage": usage(prompt_tokens, choices)}


def _message(c: Choice) -> dict:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}


def with_tool_calls(c: Choice, parsed: tuple[str, list] | None = None) -> Choice:
    """A choice whose text holds calls: the calls apart (finish_reason ``tool_calls``), the rest as text
    (``parsed``: its text's (content, calls) where already parsed)."""
    text, calls = parsed if parsed is not None else parse_calls(c.text)
    return replace(c, text=text.strip(), tool_calls=calls, finish_reason="tool_calls") if calls else c


@dataclass(frozen=True)
class ChunkMaker:
    """Builds the stream chunks of one request (same id, created and model on every chunk)."""
    rid: str
    model: str
    chat: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:  # OpenAI: null on every chunk but the last, which carries it
            out["usage"] = usage_
        return out

    def role(self, index: int) -> dict:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta(self, index: int, text: str, logprobs: dict | None = None) -> dict:
        if self.chat:
            return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                 "finish_reason": None}])
        return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def tool_calls(self, c: Choice) -> dict:
        calls = [{"index": k, **call} for k, call in enumerate(c.tool_calls or [])]
        return self._chunk([{"index": c.index, "delta": {"tool_calls": calls}, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, c: Choice) -> dict:
        if self.chat:
            return self._chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                 "finish_reason": c.finish_reason, **_extension(c)}])
        return self._chunk([{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason,
                             **_extension(c)}])

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> dict:
        return self._chunk([], usage(prompt_tokens, choices))


def models_response(model: str, created: int, metadata: dict) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specdec", **metadata}]}


# -- stop strings ----------------------------------------------------------------------------------
def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def safe_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the prefix of ``text`` that no continuation can turn into part of a stop string.

    The held-back tail is the longest suffix that is a proper prefix of some stop string.
    """
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold
