"""Hello.ignore_eos (vLLM's ignore_eos) over real gRPC on loopback: a session goes on past an
end-of-sequence token to max_new_tokens, and what it generates there is the target's own decode.

The tiny pair's end-of-sequence id is rewritten (a copy of both checkpoints) to a token its greedy
decode emits early, so the same prompt ends there without the flag (the control: EOS is honoured) and
goes on with it; the law at every position is unchanged, so the decode past it is transformers' own
greedy decode of the unchanged checkpoint, and at T = 1 the seeded race text of edge-only rounds, which
gumbel rounds reproduce token for token."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from specdec.common.modeling import encode_prompt
from specdec.device.client import EdgeError
from specdec.edge.verifier import VerifierSession
from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy

PROMPT = "w1 w2 w3"
MAX_NEW = 16
EOS_AT = 3  # the position of the decode whose token becomes the end-of-sequence id


def with_eos(src: Path, dst: Path, eos_id: int) -> Path:
    """A copy of checkpoint ``src`` whose end-of-sequence id is ``eos_id``."""
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        path = dst / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos_id
            path.write_text(json.dumps(cfg))
    return dst


def _pair_ending_at(pair, tokens: list[int], root: Path) -> tuple[Path, Path]:
    """Copies of ``pair`` whose EOS is ``tokens[EOS_AT]`` (a token first seen there, checked)."""
    eos = tokens[EOS_AT]
    assert eos not in tokens[:EOS_AT], "pick a position whose token is new to the decode"
    return with_eos(pair[0], root / "target", eos), with_eos(pair[1], root / "drafter", eos)


@pytest.fixture(scope="module")
def greedy_case(accepting_pair_v512, tmp_path_factory):
    """(the pair ending at the plain greedy decode's EOS_AT-th token, that decode of MAX_NEW tokens)."""
    target_dir, drafter_dir = accepting_pair_v512
    ids = encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True)
    plain = target_greedy(target_dir, ids, MAX_NEW)
    assert len(plain) == MAX_NEW, "the unchanged pair must not end within MAX_NEW"
    return _pair_ending_at(accepting_pair_v512, plain, tmp_path_factory.mktemp("eos_greedy")), plain


@pytest.mark.parametrize("mode", ["none", "tslt", "dssd", "gumbel", "auto"])
def test_greedy_past_an_eos_equals_the_target_alone_and_stops_there_without_the_flag(greedy_case, mode) -> None:
    (target_dir, drafter_dir), plain = greedy_case
    kw = dict(mode=mode, temperature=0.0, max_new_tokens=MAX_NEW, **({"top_k": 16} if mode == "tslt" else {}))

    async def main():
        async with edge(target_dir) as address:
            stops = await run_sessions(address, drafter_dir, device_config(**kw), PROMPT, [0])
            goes_on = await run_sessions(address, drafter_dir, device_config(ignore_eos=True, **kw), PROMPT, [0])
            return stops[0], goes_on[0]

    (stopped, _, _), (tokens, result, session) = run(main())
    assert stopped == plain[:EOS_AT + 1], "without the flag the session ends at its EOS"
    # the rewritten pair's own greedy decode would stop there too: the target alone without a stop at EOS
    # is the unchanged checkpoint's decode (the same weights, the same law)
    assert tokens == plain and result.welcome.ignores_eos, mode
    assert mode == "none" or session.stats.draft_tokens > 0  # drafts went past the EOS
    if mode == "none":  # one edge-only round streamed them all: the edge did not end it at the EOS
        assert session.stats.rounds == 1, session.stats.rounds


def test_seeded_race_text_goes_on_past_an_eos_in_edge_only_and_gumbel_rounds(accepting_pair_v512, tmp_path) -> None:
    """T = 1, one seed: edge-only rounds stream the target's race text and gumbel rounds reproduce it
    (the same position-keyed noise); with the EOS moved to a token of that text, both go on to
    MAX_NEW with the very same tokens, and the edge running ahead does not stop at it either."""
    target_dir, drafter_dir = accepting_pair_v512
    kw = dict(temperature=1.0, max_new_tokens=MAX_NEW)

    async def race(pair, mode: str, **more):
        async with edge(pair[0]) as address:
            [(tokens, _, _)] = await run_sessions(address, pair[1], device_config(mode=mode, **kw, **more), PROMPT, [7])
            return tokens

    text = run(race(accepting_pair_v512, "none"))
    assert len(text) == MAX_NEW
    pair = _pair_ending_at(accepting_pair_v512, text, tmp_path)
    assert run(race(pair, "none")) == text[:EOS_AT + 1]  # the control: the moved EOS ends it
    assert run(race(pair, "none", ignore_eos=True)) == text
    assert run(race(pair, "gumbel", ignore_eos=True)) == text


def test_a_device_stops_on_an_edge_that_would_end_at_eos(accepting_pair_v512, monkeypatch) -> None:
    """An edge from before Hello.ignore_eos would end its edge-only rounds at an EOS: the session asking
    for it fails with FAILED_PRECONDITION before any round; one without it runs on the same edge."""
    target_dir, drafter_dir = accepting_pair_v512
    older = VerifierSession.welcome
    monkeypatch.setattr(VerifierSession, "welcome", lambda self: replace(older(self), ignores_eos=False))

    async def main():
        async with edge(target_dir) as address:
            cfg = device_config(mode="none", temperature=0.0, max_new_tokens=8)
            with pytest.raises(EdgeError) as refused:
                await run_sessions(address, drafter_dir, replace(cfg, ignore_eos=True), PROMPT, [0])
            [(tokens, _, _)] = await run_sessions(address, drafter_dir, cfg, PROMPT, [0])
            return refused.value, tokens

    refused, tokens = run(main())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "ignore_eos" in refused.details
    assert len(tokens) == 8


def test_the_flag_reaches_the_hello_from_the_cli_and_the_bench() -> None:
    from specdec.bench.bench_traces import parse_args, settings_from
    from specdec.bench.traces import plan
    from specdec.device.cli import build_parser, config_from_args
    args = ["--edge", "h:1", "--prompt", "x"]
    cfg = config_from_args(build_parser().parse_args([*args, "--ignore-eos"]))
    assert cfg.hello("fp", 8, seed=0).ignore_eos
    assert not config_from_args(build_parser().parse_args(args)).hello("fp", 8, seed=0).ignore_eos
    s = settings_from(parse_args(["--ignore-eos"]))
    sess = plan.Session("c", "t", 40.0, 1.0, "none", 0, 0.0, {"mode": "none"})
    assert s.ignore_eos and sess.to_driver(["p"], 96, s.ignore_eos)["config"]["ignore_eos"] is True
    assert "ignore_eos" not in sess.to_driver(["p"], 96)["config"]
