"""`device-client` command line: parse flags, load the drafter, run sessions against the edge."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from specdec.common.adjust import MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY, LogitAdjust
from specdec.common.modeling import DTYPES
from specdec.common.modes import ALL_MODES, Mode
from specdec.common.settings import DraftSettings, check_value, setting_info, setting_names
from specdec.common.runtime import OneLineParser, apply_threads, bounded, is_local_address, run_async
from specdec.device.fleet import Selection, parse_edges
from specdec.device.factory import DeviceConfig
from specdec.device.runner import run_device

SEED_MAX = 2**64 - 1  # Hello.seed is a uint64
PORT_MAX = 65535


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    """One flag per draft setting, from the table in common/settings.py (``--top-k`` sets ``top_k``).

    A flag not given stays out of the config, so the drafter's recorded operating point (or the
    table's default) applies; the help text says what that default is."""
    defaults = DraftSettings()
    group = p.add_argument_group(
        "draft settings", "one table, common/settings.py; a flag not given takes the drafter's recorded "
        "operating point (the default drafter records L and K), else the default shown. With no draft "
        "flag at all, the device runs --mode auto")
    for name in setting_names():
        info = setting_info(name)
        flags = [_flag(name), *(_flag(a) for a in info.aliases)]
        default = getattr(defaults, name)
        shown = default.value if isinstance(default, Mode) else ",".join(map(str, default)) \
            if isinstance(default, tuple) else default
        modes = "" if info.modes == ALL_MODES else f" [{', '.join(sorted(m.value for m in info.modes))}]"
        text = f"{info.help}{modes} (default: {shown or 'off'})"
        if isinstance(default, bool):
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(*flags, dest=name, type=_setting_parser(name), default=argparse.SUPPRESS,
                               metavar=name.upper(), help=text)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _setting_parser(name: str):
    """argparse type for one setting: the text parsed, then checked by the table's own check."""
    default = getattr(DraftSettings(), name)

    def parse(text: str):
        try:
            if isinstance(default, tuple):
                value = tuple(int(k) for k in text.split(","))
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                value = type(default)(text)
            else:
                value = text
            return check_value(name, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if "must" in str(exc) else f"bad {name}: {text!r}") from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="device-client", description="specdec device client: drafts locally, verifies on the edge")
    p.add_argument("--edge", required=True, type=_edges,
                   help="edge server HOST:PORT (or a gRPC proxy in front of several); several edges as "
                        "HOST:PORT,HOST:PORT,...; or a gRPC target such as dns:///NAME:PORT, every address of "
                        "which is an edge. A session whose edge fails continues on another, exactly")
    p.add_argument("--edge-selection", choices=[s.value for s in Selection], default=Selection.LEAST_LOADED.value,
                   help="with several edges, which one a new session starts on: the one with the fewest of "
                        "this device's sessions and the shortest reported queue, or the next in turn "
                        "(default: %(default)s)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--draft-model", help="drafter: HF directory or hub id (default: the embedded default drafter)")
    p.add_argument("--draft-gguf-file", help="drafter GGUF file (inside --draft-model, or a path)")
    p.add_argument("--draft-layers", type=bounded(int, 1), help="keep only the first N drafter layers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_draft_flags(p)
    p.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false",
                   help="draft each round only after the last verdict, and ask for each edge-only round "
                        "only after the last one ended (default: draft the next round while the edge "
                        "verifies, send the next edge-only request while the last one streams; tokens are "
                        "identical either way)")
    p.add_argument("--no-run-ahead", dest="run_ahead", action="store_false",
                   help="never let the edge generate on while a round is overdue (default: where no token "
                        "depends on it, at T = 0 and in race rounds, the edge generates the target's next "
                        "tokens through an outage instead of waiting for the round)")
    p.add_argument("--no-edge-memory", dest="edge_memory", action="store_false",
                   help="mode auto: start cold and keep nothing (default: start from what this device "
                        "learned about the edge in earlier runs, $SPECDEC_CACHE_DIR/edges)")
    p.add_argument("--no-reproducible", dest="reproducible", action="store_false",
                   help="a seeded session at T > 0 may give other tokens in another run (the same law): "
                        "mode auto may choose any round and fixed modes follow the edge's load advice. "
                        "Default: the same seed gives the same tokens whatever the load, the edge, the "
                        "link and the drafter in mode auto (gumbel and edge-only rounds only), and the "
                        "same drafter's tokens in a fixed mode (the server form: for requests with a seed)")
    p.add_argument("--temperature", type=bounded(float, 0.0), default=0.0)
    p.add_argument("--target-top-p", type=bounded(float, 0.0, 1.0, low_open=True), default=0.0,
                   help="top-p of the target distribution itself (default: off)")
    p.add_argument("--target-top-k", type=bounded(int, 1), default=0,
                   help="top-k of the target distribution itself (default: off)")
    p.add_argument("--target-min-p", type=bounded(float, 0.0, 1.0), default=0.0,
                   help="min-p of the target distribution itself (default: off)")
    p.add_argument("--logit-bias", type=_logit_bias, default={},
                   help='JSON object of token id -> bias in [-100, 100] added to the target\'s logits, '
                        'e.g. \'{"50256": -100}\' (default: none)')
    p.add_argument("--presence-penalty", type=bounded(float, -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY), default=0.0,
                   help="OpenAI's presence penalty on the target's logits (default: off)")
    p.add_argument("--frequency-penalty", type=bounded(float, -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY),
                   default=0.0, help="OpenAI's frequency penalty on the target's logits (default: off)")
    p.add_argument("--repetition-penalty", type=bounded(float, 0.0, MAX_REPETITION_PENALTY, low_open=True),
                   default=1.0, help="transformers' / vLLM's repetition penalty on the target's logits "
                                     "(default: 1, off)")
    p.add_argument("--seed", type=bounded(int, 0, SEED_MAX), default=0)
    p.add_argument("--max-new-tokens", type=bounded(int, 1), default=128)
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past end-of-sequence tokens to --max-new-tokens (vLLM's ignore_eos: fixed "
                        "output lengths, as benchmarks want them; the law at each position is unchanged)")
    p.add_argument("--num-samples", type=bounded(int, 1), default=1)
    p.add_argument("--timeout", type=bounded(float, 0.0, low_open=True), default=600.0,
                   help="seconds allowed per session")
    p.add_argument("--tls-ca", help="PEM CA of the edge's certificate (enables TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument("--tls-server-name", help="name to verify in the edge's certificate (default: the host)")
    p.add_argument("--auth-token-file", help="bearer token for the edge (first line of the file)")
    p.add_argument("--round-timeout", type=bounded(float, 0.0, low_open=True), default=30.0,
                   help="seconds to wait for a verdict before treating the link as dead and resuming")
    p.add_argument("--reconnect-timeout", type=bounded(float, 0.0), default=60.0,
                   help="seconds to keep reconnecting after the stream breaks (0 = fail at once)")
    p.add_argument("--json", action="store_true", help="print one JSON object per session instead of text")
    p.add_argument("--round-log", action="store_true",
                   help="with --json: one entry per round (settings, counts, phase times; with --mode auto "
                        "the controller's choice and the estimates behind it)")
    p.add_argument("--metrics-port", type=bounded(int, 0, PORT_MAX), default=0)
    p.add_argument("--metrics-host", default="127.0.0.1", help="/metrics bind address")
    p.add_argument("--linger", type=bounded(float, 0.0), default=0.0,
                   help="keep /metrics up this many seconds after the last session (needs --metrics-port)")
    p.add_argument("--threads", type=bounded(int, 0), default=0,
                   help="torch intra-op threads (default 0: half the cores when the edge is on this host "
                        "or the host has 2 cores or fewer, else all; the choice is logged)")
    p.add_argument("--log-level", default="WARNING")
    return p


# Flags that are not DeviceConfig fields.
_NOT_CONFIG = {"threads", "log_level", "listen", "served_model_name", "connect_timeout", "api_key", "api_key_file",
               "allow_no_api_key", "chat_template", *setting_names()}


def config_from_args(a) -> DeviceConfig:
    given = vars(a)
    draft = {name: given[name] for name in setting_names() if name in given}
    adjust = LogitAdjust.of(**{name: given.pop(name) for name in ADJUST_FLAGS})
    return DeviceConfig(**{k: v for k, v in given.items() if k not in _NOT_CONFIG}, draft=draft, adjust=adjust)


# Flags that together make DeviceConfig.adjust (LogitAdjust.of's keywords).
ADJUST_FLAGS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _logit_bias(text: str) -> dict[int, float]:
    """``--logit-bias``: a JSON object of token ids (strings, as OpenAI's) to biases (argparse error else)."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        bias = {int(k): float(v) for k, v in raw.items()}
        LogitAdjust.of(bias)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return bias


# Flags only the one-shot form has. `serve` takes every other flag of build_parser(), so the draft and
# mode flags of the two forms cannot drift apart.
ONE_SHOT_ONLY = ("help", "prompt", "raw", "json", "round_log", "num_samples", "seed", "linger")
SERVE_DEFAULTS = dict(temperature=1.0,   # OpenAI's default for requests that do not name one
                      log_level="INFO",  # a daemon logs its ready line and requests
                      prompt="", raw=False, json=False, round_log=False, num_samples=1, seed=0, linger=0.0)


def _edges(text: str) -> str:
    try:
        parse_edges(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _edge_on_this_host(edge: str) -> bool:
    """Whether --edge names this machine (then the two processes share its cores)."""
    hosts = []
    for target in parse_edges(edge):
        scheme, _, rest = target.partition(":")
        if scheme in ("dns", "ipv4", "ipv6"):  # dns:///NAME:PORT, ipv4:A:P,B:P
            hosts += [a.rpartition(":")[0] for a in rest.lstrip("/").split(",")]
        else:
            hosts.append(target.rpartition(":")[0] or target)
    return any(is_local_address(h.strip("[]")) for h in hosts if h)


def build_serve_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="device-client serve",
                description="specdec device daemon: an OpenAI-compatible HTTP API over speculative decoding")
    for action in build_parser()._actions:
        if action.dest not in ONE_SHOT_ONLY:
            p._add_action(action)
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 8000),
                   help="HTTP API HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--served-model-name", default="specdec", help="model id listed by /v1/models")
    p.add_argument("--connect-timeout", type=bounded(float, 0.0, low_open=True), default=3.0,
                   help="seconds to wait for the edge before answering 503")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                     f"(also ${API_KEY_ENV}; a key on the command line is visible to other local users: "
                     "prefer --api-key-file)")
    key.add_argument("--api-key-file", help="read the API key from the first non-comment line of this file")
    p.add_argument("--chat-template", help="Jinja chat template file that replaces the drafter tokenizer's "
                                           "(one with a tools section renders `tools` itself)")
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="listen beyond loopback without an API key (refused otherwise: whoever reaches the port "
                        "uses this device's edge credentials)")
    p.set_defaults(**SERVE_DEFAULTS)
    return p


API_KEY_ENV = "SPECDEC_API_KEY"


def _api_key(args) -> str | None:
    """The daemon's API key: --api-key, --api-key-file, else $SPECDEC_API_KEY; None = no key."""
    from specdec.device.factory import read_token

    if args.api_key_file:
        return read_token(args.api_key_file)
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return key.strip() if key else None


def serve_main(argv: list[str]) -> int:
    from specdec.device.daemon import DaemonConfig, check_exposure, serve

    args = build_serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = args.listen
    try:
        cfg = DaemonConfig(device=config_from_args(args), host=host, port=port,
                           model_name=args.served_model_name, connect_timeout=args.connect_timeout,
                           api_key=_api_key(args), allow_no_api_key=args.allow_no_api_key,
                           chat_template=Path(args.chat_template).read_text() if args.chat_template else None)
        check_exposure(cfg)
    except (OSError, ValueError) as exc:  # an unreadable or empty key file, or no key beyond loopback
        sys.stderr.write(f"device-client serve: error: {exc}\n")
        return 2
    apply_threads("device-client serve", args.threads, _edge_on_this_host(args.edge))
    try:
        run_async(serve(cfg))
    except Exception as exc:  # any failure: one line and a non-zero status
        sys.stderr.write(f"device-client serve: error: {exc}\n")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.linger and not args.metrics_port:
        parser.error("--linger needs --metrics-port")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    apply_threads("device-client", args.threads, _edge_on_this_host(args.edge))
    try:
        run_async(run_device(cfg, out=sys.stdout))
    except Exception as exc:  # any failure: one line and a non-zero status
        sys.stderr.write(f"device-client: error: {exc}\n")
        return 1
    return 0

