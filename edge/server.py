"""Edge server lifecycle: load the target, serve gRPC (grpc.aio), drain and shut down on SIGTERM.

SIGTERM drains (:meth:`SpeculativeDecodingServicer.drain`): no new sessions and ``/readyz`` 503 at
once, up to ``drain_timeout_s`` for the running sessions to finish, then those still running are
ended so that their devices resume them on another edge, and the server stops. A second signal
cuts the drain short.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from specdec.common.modeling import LoadedModel, ModelSpec, load_model, target_fingerprint, vocab_fingerprint
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.common.runtime import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MAX_MESSAGE_BYTES, is_loopback
from specdec.edge.admission import AdmissionSettings
from specdec.edge.auth import Authenticator, load_tokens
from specdec.edge.batching import BatchSettings, ForwardScheduler, kv_slots
from specdec.edge.http import start_probe_server
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.servicer import SpeculativeDecodingServicer
from specdec.edge.verifier import EdgeLimits, TargetInfo

log = logging.getLogger("specdec.edge")

GRACE_SECONDS = 5.0  # in-flight rounds get this long to finish once the drain is over
# Sessions still running when the drain time is up are ended at their next message (a round boundary,
# milliseconds away for a working device); this long for them to get there before the server stops.
MOVE_GRACE_SECONDS = 2.0
MIN_CLIENT_PING_INTERVAL_MS = 5_000  # devices may ping this often (they ping every KEEPALIVE_TIME_MS)


@dataclass(frozen=True)
class TlsConfig:
    cert: str                      # PEM server certificate chain
    key: str                       # PEM private key
    client_ca: str | None = None   # PEM CA; set = mutual TLS, clients must present a cert it signed


@dataclass(frozen=True)
class EdgeConfig:
    model: ModelSpec = field(default_factory=ModelSpec)   # the target
    host: str = "127.0.0.1"                               # bind address
    port: int = 50051                                     # 0 = pick a free port
    metrics_port: int = 0                                 # /metrics, /healthz, /readyz; 0 = none
    workers: int = 4                                      # threads running sessions' work (at least
                                                          # max_sessions when batching: each may join a forward)
    batching: BatchSettings = field(default_factory=BatchSettings)  # target forwards shared across sessions
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)  # per-principal cap, queue
    tls: TlsConfig | None = None                          # None = plaintext (loopback and labs)
    auth_token_file: str | None = None                    # bearer tokens accepted, one per line
    max_message_bytes: int = MAX_MESSAGE_BYTES            # larger messages are refused by gRPC
    name: str = ""                                        # this edge in a fleet (Welcome.edge_name);
                                                          # "" = HOSTNAME:PORT
    # SIGTERM: how long running sessions may take to finish before they are sent to another edge.
    # Under Kubernetes' default terminationGracePeriodSeconds of 30 with room for the stop after it.
    drain_timeout_s: float = 20.0


def target_info(target: LoadedModel) -> TargetInfo:
    return TargetInfo(name=target.name, vocab_size=target.vocab_size,
                      fingerprint=vocab_fingerprint(target.tokenizer), max_context=target.max_context,
                      target_fingerprint=target_fingerprint(target.model, target.tokenizer))


async def start_server(cfg: EdgeConfig, target: LoadedModel, metrics: EdgeMetrics | None = None):
    """Create and start the grpc.aio server inside the running loop; returns (server, port)."""
    scheduler = None
    workers = cfg.workers
    if cfg.batching.enabled:
        batching = cfg.batching.resolved(target.device)
        scheduler = ForwardScheduler(batching, metrics.observe_batch if metrics else None,
                                     pool=kv_slots(batching, target.model, target.device), device=target.device)
        log.info("batching: up to %d tokens per forward, wait %.1f ms, KV cache %s",
                 scheduler.settings.max_batch_tokens, scheduler.settings.wait_s * 1e3,
                 "slots" if scheduler.pool is not None else "per session")
        workers = max(workers, cfg.limits.max_sessions)  # waiting threads cost no CPU
        probe = scheduler.new_lm(target.model, target.device)
        await asyncio.get_running_loop().run_in_executor(
            None, scheduler.calibrate, probe, target.vocab_size,
            min(cfg.limits.max_context or target.max_context, target.max_context))
        scheduler.forget(probe)
    executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
    auth = authenticator(cfg)
    servicer = SpeculativeDecodingServicer(target, target_info(target), cfg.limits, executor, metrics, auth,
                                           admission=cfg.admission, scheduler=scheduler)
    server = grpc.aio.server(options=server_options(cfg))
    pb_grpc.add_SpeculativeDecodingServicer_to_server(servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls is None:
        if not is_loopback(cfg.host):
            log.warning("serving PLAINTEXT on non-loopback %s: traffic and tokens travel unencrypted; "
                        "use --tls-cert/--tls-key outside a lab", cfg.host)
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials(cfg.tls))
    if port == 0:
        raise OSError(f"cannot bind {cfg.host}:{cfg.port}")
    servicer.name = cfg.name or f"{socket.gethostname()}:{port}"
    await server.start()
    server._specdec_executor = executor  # shut down with the server
    server._specdec_scheduler = scheduler
    server._specdec_servicer = servicer
    return server, port


def server_options(cfg: EdgeConfig) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0)]


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    key, cert = Path(tls.key).read_bytes(), Path(tls.cert).read_bytes()
    client_ca = Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def authenticator(cfg: EdgeConfig) -> Authenticator:
    tokens = load_tokens(cfg.auth_token_file) if cfg.auth_token_file else frozenset()
    return Authenticator(token_digests=tokens, require_client_cert=bool(cfg.tls and cfg.tls.client_ca))


async def stop_server(server, grace: float = GRACE_SECONDS) -> None:
    await server.stop(grace)
    if server._specdec_scheduler is not None:
        server._specdec_scheduler.stop()
    server._specdec_executor.shutdown(wait=False, cancel_futures=True)


async def drain_server(server, drain_timeout_s: float, cut_short: asyncio.Event | None = None) -> None:
    """Drain (see the module docstring), then stop the server."""
    registry = server._specdec_servicer.registry
    drain = asyncio.ensure_future(registry.drain(drain_timeout_s))
    waits = [drain] + ([asyncio.ensure_future(cut_short.wait())] if cut_short is not None else [])
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits[1:]:
        w.cancel()
    if not drain.done():  # a second signal: stop now
        drain.cancel()
        registry.moving = True
    with contextlib.suppress(asyncio.CancelledError):
        left = await drain
        if left:
            log.info("drain time is up: sending %d running sessions to another edge", left)
            await registry.wait_streams_ended(MOVE_GRACE_SECONDS)
    await stop_server(server)


async def serve(cfg: EdgeConfig, load: Callable[[ModelSpec], LoadedModel] = load_model) -> None:
    """Load the model (with ``load``: the bench's slower-edge emulation wraps it), serve until
    SIGTERM/SIGINT, then drain and stop."""
    authenticator(cfg)  # a bad token file fails before the model is loaded
    target = load(cfg.model)
    metrics = EdgeMetrics()
    metrics.set_model(target.name, target.vocab_size)
    server, port = await start_server(cfg, target, metrics)
    probes = None
    if cfg.metrics_port:
        probes, _ = await start_probe_server(cfg.host, cfg.metrics_port, metrics.registry,
                                             server._specdec_servicer.registry.readiness)
    signals = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.set)
    # After the handlers: a supervisor may send SIGTERM as soon as it reads this line.
    log.info("edge-server ready on %s:%d model=%s vocab=%d name=%s", cfg.host, port, target.name,
             target.vocab_size, server._specdec_servicer.name)
    await signals.wait()
    signals.clear()
    log.info("edge-server draining: no new sessions; running ones get up to %.0f s", cfg.drain_timeout_s)
    await drain_server(server, cfg.drain_timeout_s, signals)
    if probes is not None:
        await probes.cleanup()
    log.info("edge-server stopped")
