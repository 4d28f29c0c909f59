"""device/tools.py: the call grammar's shape, parsing calls out of an answer, and streaming an answer
that may hold calls without showing a call's text."""
from __future__ import annotations

import json

import pytest

from specdec.device.tools import CALL_CLOSE, CALL_OPEN, CallGuard, ToolError, call_grammar, parse_calls, \
    parse_tool_choice, parse_tools

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _stream(chunks: list[str]) -> tuple[str, str, list]:
    guard = CallGuard()
    shown = "".join(guard.add(c) for c in chunks)
    rest, _, calls = guard.finish("".join(chunks))
    return shown, rest, calls


def test_text_without_calls_streams_as_it_comes_but_a_possible_opening() -> None:
    guard = CallGuard()
    assert guard.add("Hello <to") == "Hello "  # "<to" may begin a call
    assert guard.add("day>") == "<today>"
    assert guard.finish("Hello <today>") == ("", "Hello <today>", [])


@pytest.mark.parametrize("cut", range(1, 40, 3))
def test_a_call_never_shows_as_text_wherever_the_chunks_break(cut) -> None:
    answer = f'Let me check. {CALL_OPEN}{{"name": "f", "arguments": {{"x": 1}}}}{CALL_CLOSE}'
    shown, rest, calls = _stream([answer[:cut], answer[cut:]])
    assert CALL_OPEN not in shown and shown + rest == "Let me check. "
    assert [c["function"]["name"] for c in calls] == ["f"] and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_a_malformed_call_stays_text() -> None:
    text, calls = parse_calls(f"{CALL_OPEN}not json{CALL_CLOSE} tail")
    assert calls == [] and text == f"{CALL_OPEN}not json{CALL_CLOSE} tail"


def test_the_call_grammar_names_only_the_chosen_functions() -> None:
    tools = parse_tools([F, {**F, "function": {**F["function"], "name": "g"}}])
    assert call_grammar(tools, "auto") is None and call_grammar(tools, "none") is None
    assert '"const": "g"' in call_grammar(tools, "g").source and '"const": "f"' not in call_grammar(tools, "g").source
    assert "anyOf" in call_grammar(tools, "required").source


@pytest.mark.parametrize("raw, param", [({"type": "function", "function": {"name": "h"}}, "tool_choice"),
                                        ("sometimes", "tool_choice")])
def test_a_bad_tool_choice_names_its_field(raw, param) -> None:
    with pytest.raises(ToolError) as err:
        parse_tool_choice(raw, parse_tools([F]))
    assert err.value.param == param
