"""OpenAI tools on the daemon: the request's ``tools`` and ``tool_choice``, how they reach the prompt,
the grammar that enforces ``required`` and a named function, and the answer parsed into ``tool_calls``.
Pure functions over plain data (no sockets, no model).

A call is written as the Hermes / Qwen convention writes it, which many instruction-tuned models
learned: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Where the drafter tokenizer's
chat template has a tools section, the tools go through it (``apply_chat_template(tools=...)``);
otherwise (the embedded SmolLM2's has none) a system message states them and the format
(:func:`tools_system_prompt`), as vLLM's generic tool templates do. ``serve --chat-template FILE``
replaces the tokenizer's template altogether.

With ``tool_choice`` ``required`` or a named function the answer must be a call, so the session's
grammar (common/grammar.py, Lark with an embedded JSON schema) allows only calls of those functions
with arguments that match their ``parameters`` schema: they always parse, even from a 135M model.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdec.common.grammar import Grammar, GrammarKind

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit on `tools`
# A schema without whitespace choices: a model is not made to choose among runs of it.
_COMPACT = {"whitespace_flexible": False}


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` (the message names the problem; ``param`` the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str   # its JSON schema, as JSON text (hashable)

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(self.parameters)}}


def parse_tools(raw) -> tuple[Tool, ...]:
    """``tools``: a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolError(f"`tools` must be a list of at most {MAX_TOOLS} functions", "tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError("each tool is {\"type\": \"function\", \"function\": {\"name\": ...}}", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError("`parameters` must be a JSON schema object", f"tools[{i}].function.parameters")
        tools.append(Tool(fn["name"], str(fn.get("description", "")), json.dumps(params)))
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("tool names must be distinct", "tools")
    return tuple(tools)


def parse_tool_choice(raw, tools: tuple[Tool, ...]) -> str:
    """``none`` / ``auto`` / ``required`` or a function's name; default ``auto`` with tools, else ``none``."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise ToolError(f"`tool_choice` {raw!r} needs `tools`", "tool_choice")
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolError("`tool_choice` is none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ToolError(f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice")
    return name


def call_grammar(tools: tuple[Tool, ...], choice: str) -> Grammar | None:
    """The grammar of an answer that must be a call (``required``: of any tool; a name: of that one)."""
    if choice in ("none", "auto"):
        return None
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = {"x-guidance": _COMPACT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    return Grammar(GrammarKind.LARK, f'start: "{CALL_OPEN}" call "{CALL_CLOSE}"\ncall: %json {json.dumps(schema)}')


def tools_system_prompt(tools: tuple[Tool, ...]) -> str:
    """The generic template's statement of the tools and of the call format."""
    listed = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
    return ("You can call these functions:\n" + listed + "\nTo call one, answer with "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE}')


def with_tools(messages: list[dict], tools: tuple[Tool, ...], template_takes_tools: bool) -> list[dict]:
    """The conversation as the chat template receives it: earlier calls as their text, and (for a
    template without a tools section) the tools stated in a system message in front."""
    out = []
    for m in messages:
        calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"].get("arguments") or "{}")}
                 for c in m.get("tool_calls") or []]
        text = "".join(f"{CALL_OPEN}{json.dumps(call)}{CALL_CLOSE}" for call in calls)
        out.append({"role": m["role"], "content": (m.get("content") or "") + text})
    if tools and not template_takes_tools:
        out.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
    return out


def parse_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside calls, the calls in OpenAI's ``tool_calls`` shape) of an answer; a call whose
    JSON does not parse stays text."""
    content, calls, rest = [], [], text
    while CALL_OPEN in rest:
        before, _, after = rest.partition(CALL_OPEN)
        body, closed, rest = after.partition(CALL_CLOSE)
        try:
            call = json.loads(body) if closed else None
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            content.append(before + CALL_OPEN + body + closed)
            continue
        content.append(before)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    content.append(rest)
    return "".join(content), calls


class CallGuard:
    """One streamed answer's text shown as it comes while it cannot be (the start of) a call: from the
    first CALL_OPEN on, and any tail that could begin one, it is held back; the rest of the answer,
    its calls apart, comes with :meth:`finish`."""

    def __init__(self):
        self.text = ""
        self.shown = 0

    def add(self, delta: str) -> str:
        self.text += delta
        cut = self.text.find(CALL_OPEN)
        if cut < 0:
            cut = len(self.text) - _open_tail(self.text)
        cut = max(cut, self.shown)
        out, self.shown = self.text[self.shown:cut], cut
        return out

    def finish(self, text: str) -> tuple[str, str, list[dict]]:
        """(the content not shown yet, the whole content, the calls) of the whole answer ``text``: the
        shown text is the content's start, which holds no call."""
        content, calls = parse_calls(text)
        return content[self.shown:], content, calls


def _open_tail(text: str) -> int:
    """The length of the longest end of ``text`` that begins CALL_OPEN."""
    return max((k for k in range(1, len(CALL_OPEN)) if text.endswith(CALL_OPEN[:k])), default=0)
