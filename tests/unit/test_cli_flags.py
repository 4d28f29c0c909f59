"""Both command lines check numeric flags the one way (common/runtime.bounded): a bad value exits with
status 2 and one line that names the flag and says what it must be; a good one parses to its type."""
from __future__ import annotations

import pytest

from specdec.device import cli as device_cli
from specdec.edge import __main__ as edge_cli

DEVICE = ["--edge", "127.0.0.1:1", "--prompt", "hi"]


@pytest.mark.parametrize("parser, args, flag, needle", [
    (edge_cli.build_parser, ["--max-sessions", "0"], "--max-sessions", "must be an int >= 1, got 0"),
    (edge_cli.build_parser, ["--admission-queue", "-1"], "--admission-queue", "must be an int >= 0"),
    (edge_cli.build_parser, ["--batch-wait-ms", "nan"], "--batch-wait-ms", "must be a finite real >= 0"),
    (edge_cli.build_parser, ["--idle-timeout", "0"], "--idle-timeout", "must be a finite real > 0"),
    (edge_cli.build_parser, ["--port", "70000"], "--port", "must be an int in [0, 65535]"),
    (edge_cli.build_parser, ["--workers", "two"], "--workers", "not a valid int"),
    (device_cli.build_parser, [*DEVICE, "--timeout", "0"], "--timeout", "must be a finite real > 0"),
    (device_cli.build_parser, [*DEVICE, "--temperature", "inf"], "--temperature", "must be a finite real >= 0"),
    (device_cli.build_parser, [*DEVICE, "--target-top-p", "1.5"], "--target-top-p", "must be a finite real in (0, 1]"),
    (device_cli.build_parser, [*DEVICE, "--logit-bias", '{"5": 200}'], "--logit-bias", "outside [-100, 100]"),
    (device_cli.build_parser, [*DEVICE, "--logit-bias", "[1]"], "--logit-bias", "not a JSON object"),
    (device_cli.build_parser, [*DEVICE, "--presence-penalty", "3"], "--presence-penalty", "must be a finite real in [-2"),
    (device_cli.build_parser, [*DEVICE, "--repetition-penalty", "0"], "--repetition-penalty", "must be a finite real in (0"),
    (device_cli.build_parser, [*DEVICE, "--target-min-p", "2"], "--target-min-p", "must be a finite real in [0"),
    (device_cli.build_parser, [*DEVICE, "--seed", "-1"], "--seed", "must be an int in [0, 18446744073709551615]"),
    (device_cli.build_serve_parser, ["--edge", "127.0.0.1:1", "--connect-timeout", "-2"], "--connect-timeout",
     "must be a finite real > 0"),
])
def test_a_bad_value_is_one_line_naming_the_flag(parser, args, flag, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(args)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and needle in lines[0], lines


def test_good_values_parse_to_their_types() -> None:
    edge = edge_cli.build_parser().parse_args(["--max-sessions", "8", "--batch-wait-ms", "0", "--port", "0"])
    assert (edge.max_sessions, edge.batch_wait_ms, edge.port) == (8, 0.0, 0)
    device = device_cli.build_parser().parse_args([*DEVICE, "--temperature", "0.5", "--seed", str(2**64 - 1)])
    assert (device.temperature, device.seed) == (0.5, 2**64 - 1)


@pytest.mark.parametrize("args", [["--cuda-graphs", "on", "--device", "cpu"],
                                  ["--cuda-graphs", "on", "--device", "cpu", "--kv-cache", "slots"]])
def test_cuda_graphs_on_a_cpu_is_one_line_before_the_model_loads(args, capsys) -> None:
    assert edge_cli.main(["--model", "/nonexistent", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["edge-server: error: CUDA graphs need a CUDA device and batching with KV slots (--kv-cache slots)"]


def test_noise_ahead_follows_the_flag_and_without_batching_is_one_line(capsys) -> None:
    parse = edge_cli.build_parser().parse_args
    assert edge_cli.config_from_args(parse(["--noise-ahead", "on"])).batching.noise_ahead == "on"
    assert edge_cli.config_from_args(parse([])).batching.noise_ahead == "auto"
    assert edge_cli.main(["--model", "/nonexistent", "--noise-ahead", "on", "--no-batching"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["edge-server: error: noise ahead is drawn while a batched forward runs: it needs batching"]


def test_the_law_flags_make_one_logit_adjust() -> None:
    args = device_cli.build_parser().parse_args([*DEVICE, "--logit-bias", '{"7": -100, "3": 2.5}', "--presence-penalty",
                                                 "0.5", "--repetition-penalty", "1.2", "--target-min-p", "0.1"])
    cfg = device_cli.config_from_args(args)
    assert cfg.adjust.logit_bias == ((3, 2.5), (7, -100.0)) and cfg.adjust.presence_penalty == 0.5
    assert cfg.adjust.repetition_penalty == 1.2 and cfg.adjust.frequency_penalty == 0.0 and cfg.target_min_p == 0.1
    assert cfg.hello("f", 16, seed=0).adjust == cfg.adjust
