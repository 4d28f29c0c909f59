"""`device-client` command line: parse flags, load the drafter, run sessions against the edge."""
from __future__ import annotations

import argparse
import logging
import sys

from specdec.common.codecs import Mode
from specdec.common.modeling import DTYPES
from specdec.common.runtime import OneLineParser, apply_threads, is_local_address, run_async
from specdec.device.runner import DeviceConfig, run_device




def _bounded(kind, low, high=None, *, low_open=False):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            rng = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {rng}")
        return value
    return parse


def _tree_config(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,2,2, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"every branching factor must be >= 1, got {text!r}")
    return ks


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="device-client", description="specdec device client: drafts locally, verifies on the edge")
    p.add_argument("--edge", required=True, help="edge server HOST:PORT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--draft-model", help="drafter: HF directory or hub id (default: interim embedded drafter)")
    p.add_argument("--draft-gguf-file", help="drafter GGUF file (inside --draft-model, or a path)")
    p.add_argument("--draft-layers", type=_bounded(int, 1), help="keep only the first N drafter layers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--mode", default="tslt", choices=[m.value for m in Mode])
    p.add_argument("--top-k", type=_bounded(int, 1), default=None,
                   help="tslt / ksqs support size K (default: the default drafter's recorded K, else 64)")
    p.add_argument("--top-p", type=_bounded(float, 0.0, 1.0, low_open=True), default=None,
                   help="tslt nucleus mass (instead of top-K)")
    p.add_argument("--lattice", type=_bounded(int, 1), default=1000, help="ksqs / csqs lattice resolution")
    p.add_argument("--dense-dtype", default="fp16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--alpha", type=_bounded(float, 0.0, 1.0, low_open=True), default=0.01, help="C-SQS target deviation")
    p.add_argument("--eta", type=_bounded(float, 0.0, low_open=True), default=0.001, help="C-SQS learning rate")
    p.add_argument("--beta0", type=_bounded(float, 0.0, 1.0), default=0.001, help="C-SQS initial threshold")
    p.add_argument("--max-k", type=_bounded(int, 1), default=4096, help="C-SQS support cap")
    p.add_argument("--dssd-samples", type=_bounded(int, 1), default=8)
    p.add_argument("--tree", type=_tree_config, default=(),
                   help="token tree expansion configuration, e.g. 2,2,2 (default: a chain of --draft-len)")
    p.add_argument("--draft-len", type=_bounded(int, 1), default=None,
                   help="chain length L (default: the default drafter's measured best, else 4)")
    p.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false",
                   help="draft each round only after the last verdict (default: draft the next round "
                        "while the edge verifies; tokens are identical either way)")
    p.add_argument("--no-coupled-bonus", dest="coupled_bonus", action="store_false",
                   help="let the edge draw the bonus token from its own stream (default in chain rounds "
                        "outside dssd: from noise both sides derive from the seed, so drafting ahead can "
                        "guess it at T > 0; lossless either way)")
    p.add_argument("--bit-budget", type=_bounded(int, 1), default=None, help="per-round uplink bits B")
    p.add_argument("--temperature", type=_bounded(float, 0.0), default=0.0)
    p.add_argument("--target-top-p", type=_bounded(float, 0.0, 1.0, low_open=True), default=None)
    p.add_argument("--target-top-k", type=_bounded(int, 1), default=None)
    p.add_argument("--seed", type=_bounded(int, 0), default=0)
    p.add_argument("--max-new-tokens", type=_bounded(int, 1), default=128)
    p.add_argument("--num-samples", type=_bounded(int, 1), default=1)
    p.add_argument("--timeout", type=_bounded(float, 0.0, low_open=True), default=600.0,
                   help="seconds allowed per session")
    p.add_argument("--tls-ca", help="PEM CA of the edge's certificate (enables TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument("--tls-server-name", help="name to verify in the edge's certificate (default: the host)")
    p.add_argument("--auth-token-file", help="bearer token for the edge (first line of the file)")
    p.add_argument("--round-timeout", type=_bounded(float, 0.0, low_open=True), default=30.0,
                   help="seconds to wait for a verdict before treating the link as dead and resuming")
    p.add_argument("--reconnect-timeout", type=_bounded(float, 0.0), default=60.0,
                   help="seconds to keep reconnecting after the stream breaks (0 = fail at once)")
    p.add_argument("--json", action="store_true", help="print one JSON object per session instead of text")
    p.add_argument("--metrics-port", type=_bounded(int, 0), default=0)
    p.add_argument("--metrics-host", default="127.0.0.1", help="/metrics bind address")
    p.add_argument("--linger", type=_bounded(float, 0.0), default=0.0,
                   help="keep /metrics up this many seconds after the last session (needs --metrics-port)")
    p.add_argument("--threads", type=_bounded(int, 0), default=0,
                   help="torch intra-op threads (default 0: half the cores when the edge is on this host "
                        "or the host has 2 cores or fewer, else all; the choice is logged)")
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(a) -> DeviceConfig:
    return DeviceConfig(
        edge=a.edge, prompt=a.prompt, raw=a.raw, draft_model=a.draft_model,
        draft_gguf_file=a.draft_gguf_file, draft_layers=a.draft_layers, device=a.device, dtype=a.dtype,
        mode=Mode(a.mode), top_k=a.top_k, top_p=a.top_p or 0.0, lattice=a.lattice,
        dense_dtype=a.dense_dtype, csqs_alpha=a.alpha, csqs_eta=a.eta, csqs_beta0=a.beta0,
        max_k=a.max_k, dssd_samples=a.dssd_samples, tree=a.tree, draft_len=a.draft_len, draft_ahead=a.draft_ahead,
        coupled_bonus=a.coupled_bonus,
        bit_budget=a.bit_budget or 0, temperature=a.temperature, target_top_p=a.target_top_p or 0.0,
        target_top_k=a.target_top_k or 0, seed=a.seed, max_new_tokens=a.max_new_tokens,
        num_samples=a.num_samples, timeout=a.timeout, json=a.json, metrics_port=a.metrics_port,
        metrics_host=a.metrics_host, linger=a.linger, tls_ca=a.tls_ca, tls_cert=a.tls_cert,
        tls_key=a.tls_key, tls_server_name=a.tls_server_name, auth_token_file=a.auth_token_file,
        round_timeout=a.round_timeout, reconnect_timeout=a.reconnect_timeout,
    )


# Flags only the one-shot form has. `serve` takes every other flag of build_parser(), so the draft and
# mode flags of the two forms cannot drift apart.
ONE_SHOT_ONLY = ("help", "prompt", "raw", "json", "num_samples", "seed", "linger")
SERVE_DEFAULTS = dict(temperature=1.0,   # OpenAI's default for requests that do not name one
                      log_level="INFO",  # a daemon logs its ready line and requests
                      prompt="", raw=False, json=False, num_samples=1, seed=0, linger=0.0)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _edge_on_this_host(edge: str) -> bool:
    """Whether --edge names this machine (then the two processes share its cores)."""
    host = edge.rpartition(":")[0] or edge
    return is_local_address(host)


def build_serve_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="device-client serve",
                description="specdec device daemon: an OpenAI-compatible HTTP API over speculative decoding")
    for action in build_parser()._actions:
        if action.dest not in ONE_SHOT_ONLY:
            p._add_action(action)
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 8000),
                   help="HTTP API HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--served-model-name", default="specdec", help="model id listed by /v1/models")
    p.add_argument("--connect-timeout", type=_bounded(float, 0.0, low_open=True), default=3.0,
                   help="seconds to wait for the edge before answering 503")
    p.set_defaults(**SERVE_DEFAULTS)
    return p


def serve_main(argv: list[str]) -> int:
    from specdec.device.daemon import DaemonConfig, serve

    args = build_serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = args.listen
    cfg = DaemonConfig(device=config_from_args(args), host=host, port=port,
                       model_name=args.served_model_name, connect_timeout=args.connect_timeout)
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


if __name__ == "__main__":
    sys.exit(main())
