"""`edge-server` command line: parse flags into an EdgeConfig and run the server."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from specdec.common.modeling import DTYPES, LoadedModel, ModelSpec, load_model, resolve_device
from specdec.common.runtime import (MAX_MESSAGE_BYTES, OneLineParser, apply_threads, bounded, is_loopback,
                                    retain_freed_memory, run_async)
from specdec.edge.admission import AdmissionSettings
from specdec.edge.batching import CUDA_GRAPHS, DEVICE_DEFAULTS, KV_CACHES, VERIFY_OVERLAP, BatchSettings
from specdec.edge.noise_ahead import NOISE_AHEAD
from specdec.edge.server import EdgeConfig, TlsConfig, serve
from specdec.edge.verifier import EdgeLimits

PORT_MAX = 65535  # 0: any free port


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="edge-server", description="specdec edge server: verifies drafts with the target model")
    p.add_argument("--model", help="target: HF directory or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="GGUF file (inside --model, or a path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=bounded(int, 0, PORT_MAX), default=50051)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--metrics-port", type=bounded(int, 0, PORT_MAX), default=0,
                   help="serve Prometheus /metrics, /healthz and /readyz (503 while draining or full) here (0 = off)")
    p.add_argument("--name", default="", help="this edge's name in a fleet, reported to devices in Welcome "
                   "(default: HOSTNAME:PORT; under Kubernetes the pod name)")
    p.add_argument("--drain-timeout", type=bounded(float, 0.0), default=EdgeConfig.drain_timeout_s, metavar="S",
                   help="on SIGTERM: take no new sessions and give running ones this long to finish, then end "
                   "them so that their devices resume them on another edge (default: %(default)g)")
    p.add_argument("--workers", type=bounded(int, 1), default=4,
                   help="threads running sessions' work (decoding drafts, verification); with batching at "
                   "least --max-sessions, since each waits for its share of a shared forward (default: %(default)s)")
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    p.add_argument("--no-batching", action="store_true",
                   help="every session runs its own target forwards (one session per forward, as before "
                   "batching); default: the forwards of all sessions ready at once run as one")
    p.add_argument("--max-batch-tokens", type=bounded(int, 1), default=None, metavar="N",
                   help="new tokens (all sessions) per target forward; longer prompts are prefilled in "
                   f"chunks of this size (default: {cpu.max_batch_tokens} on CPU, {gpu.max_batch_tokens} on CUDA)")
    p.add_argument("--batch-wait-ms", type=bounded(float, 0.0), default=None, metavar="MS",
                   help="longest a ready forward waits for sessions still decoding their round; it starts "
                   f"at once when every working session has handed in (default: {cpu.wait_s * 1e3:g} on CPU, "
                   f"{gpu.wait_s * 1e3:g} on CUDA)")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="auto",
                   help="where the sessions' target KV caches live with batching: 'slots' = one preallocated "
                   "cache with a row per session, read in place by every forward; 'per-session' = each "
                   "session's own, copied into each batched forward; auto = slots on CUDA, per-session on "
                   "CPU (default: %(default)s)")
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default="auto",
                   help="replay the chain forwards of KV slots (verification rounds, edge-only tokens) from "
                   "CUDA graphs captured per shape, instead of launching each forward's kernels; on needs "
                   "CUDA and --kv-cache slots; auto = on where KV slots run on CUDA (default: %(default)s)")
    p.add_argument("--noise-ahead", choices=NOISE_AHEAD, default="auto",
                   help="at T > 0 each session's thread draws the race and bonus noise its round may read while "
                   "the batched forward runs, instead of the scheduler after it (host work that a GPU forward "
                   "leaves the cores free for, and a CPU forward does not); auto = on on CUDA, off on CPU "
                   "(default: %(default)s)")
    p.add_argument("--verify-overlap", choices=VERIFY_OVERLAP, default="auto",
                   help="verify a batched forward's rounds on a thread of their own while the next forward runs "
                   "for the sessions not waiting on them, instead of between forwards (verification is mostly "
                   "host work, which leaves a GPU idle; a CPU forward needs the same cores); auto = on on CUDA, "
                   "off on CPU (default: %(default)s)")
    p.add_argument("--max-sessions", type=bounded(int, 1), default=64,
                   help="sessions held at once, detached ones waiting for a resume included")
    admit = AdmissionSettings()
    p.add_argument("--max-sessions-per-principal", type=bounded(int, 0), default=admit.max_sessions_per_principal,
                   metavar="N", help="sessions one principal (its bearer token or client certificate; without "
                   "authentication, its host) may hold or wait for, detached ones included; more are refused "
                   "with RESOURCE_EXHAUSTED; 0 = no cap (default: half of --max-sessions, so no one client can "
                   "hold every slot for a resume window, while one device daemon, all of whose requests are "
                   "one principal, still gets half the edge)")
    p.add_argument("--admission-queue", type=bounded(int, 0), default=admit.queue, metavar="N",
                   help="new sessions that may wait for a slot while --max-sessions are held; beyond that "
                   "RESOURCE_EXHAUSTED at once; 0 = no queue (default: %(default)s)")
    p.add_argument("--admission-wait-ms", type=bounded(float, 0.0, low_open=True), default=admit.wait_s * 1000, metavar="MS",
                   help="how long a queued session waits for a slot before RESOURCE_EXHAUSTED (default: "
                   "%(default)g, well within a device's --round-timeout, which bounds its wait for Welcome)")
    p.add_argument("--max-context", type=bounded(int, 0), default=0, help="0 = the model's context length")
    p.add_argument("--max-draft-len", type=bounded(int, 1), default=EdgeLimits.max_draft_len)
    p.add_argument("--max-k", type=bounded(int, 1), default=EdgeLimits.max_k)
    p.add_argument("--idle-timeout", type=bounded(float, 0.0, low_open=True), default=120.0,
                   help="seconds a session may stay silent before it is closed")
    p.add_argument("--resume-window", type=bounded(float, 0.0, low_open=True), default=60.0,
                   help="seconds a session whose stream broke is kept for the device to resume")
    p.add_argument("--max-prompt", type=bounded(int, 0), default=0, help="prompt tokens per session (0 = context)")
    p.add_argument("--max-message-bytes", type=bounded(int, 1), default=MAX_MESSAGE_BYTES)
    p.add_argument("--tls-cert", help="PEM server certificate chain (enables TLS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA for client certificates (enables mutual TLS)")
    p.add_argument("--auth-token-file", help="accepted bearer tokens, one per line")
    p.add_argument("--threads", type=bounded(int, 0), default=0,
                   help="torch intra-op threads (default 0: half the cores when --host is loopback, so "
                        "devices run here, or the host has 2 cores or fewer, else all; the choice is logged)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(a) -> EdgeConfig:
    limits = EdgeLimits(max_sessions=a.max_sessions, max_context=a.max_context,
                        max_draft_len=a.max_draft_len, max_k=a.max_k, idle_timeout_s=a.idle_timeout,
                        resume_window_s=a.resume_window, max_prompt_tokens=a.max_prompt)
    spec = ModelSpec(model=a.model, gguf_file=a.gguf_file, device=a.device, dtype=a.dtype)
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if a.tls_client_ca and not a.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = TlsConfig(cert=a.tls_cert, key=a.tls_key, client_ca=a.tls_client_ca) if a.tls_cert else None
    admission = AdmissionSettings(max_sessions_per_principal=a.max_sessions_per_principal,
                                  queue=a.admission_queue, wait_s=a.admission_wait_ms / 1000)
    batching = BatchSettings(enabled=not a.no_batching, max_batch_tokens=a.max_batch_tokens,
                             wait_s=None if a.batch_wait_ms is None else a.batch_wait_ms / 1000,
                             kv_cache=a.kv_cache, cuda_graphs=a.cuda_graphs, noise_ahead=a.noise_ahead,
                             verify_overlap=a.verify_overlap)
    if batching.enabled or "on" in (a.cuda_graphs, a.noise_ahead, a.verify_overlap):
        batching.resolved(resolve_device(a.device))  # a bad combination fails here, before the model loads
    return EdgeConfig(model=spec, host=a.host, port=a.port, metrics_port=a.metrics_port,
                      workers=a.workers, batching=batching, limits=limits, admission=admission, tls=tls,
                      auth_token_file=a.auth_token_file, max_message_bytes=a.max_message_bytes,
                      name=a.name, drain_timeout_s=a.drain_timeout)


def main(argv: list[str] | None = None, load: Callable[[ModelSpec], LoadedModel] = load_model) -> int:
    """``load``: the target's loader (the bench's slower-edge emulation passes a wrapped one)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"edge-server: error: {exc}\n")
        return 2
    apply_threads("edge-server", args.threads, is_loopback(args.host))
    retain_freed_memory()
    try:
        run_async(serve(cfg, load))
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"edge-server: error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
