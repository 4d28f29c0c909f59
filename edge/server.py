"""Edge server lifecycle: load the target, serve gRPC (grpc.aio), shut down gracefully on SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from specdec.common.modeling import LoadedModel, ModelSpec, load_model, vocab_fingerprint
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.servicer import SpeculativeDecodingServicer
from specdec.edge.verifier import EdgeLimits, TargetInfo

log = logging.getLogger("specdec.edge")

# Largest message either side accepts: a dense fp32 round over a 152k vocabulary with L = 32 is
# ~20 MB; the edge limit on draft length keeps real rounds below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRACE_SECONDS = 5.0  # in-flight rounds get this long to finish on SIGTERM


@dataclass(frozen=True)
class EdgeConfig:
    model: ModelSpec = field(default_factory=ModelSpec)   # the target
    host: str = "127.0.0.1"                               # bind address
    port: int = 50051                                     # 0 = pick a free port
    metrics_port: int = 0                                 # 0 = no /metrics endpoint
    workers: int = 4                                      # threads running target forwards
    limits: EdgeLimits = field(default_factory=EdgeLimits)


def target_info(target: LoadedModel) -> TargetInfo:
    return TargetInfo(name=target.name, vocab_size=target.vocab_size,
                      fingerprint=vocab_fingerprint(target.tokenizer), max_context=target.max_context)


async def start_server(cfg: EdgeConfig, target: LoadedModel, metrics: EdgeMetrics | None = None):
    """Create and start the grpc.aio server inside the running loop; returns (server, port)."""
    executor = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="verify")
    servicer = SpeculativeDecodingServicer(target, target_info(target), cfg.limits, executor, metrics)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.aio.server(options=options)
    pb_grpc.add_SpeculativeDecodingServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise OSError(f"cannot bind {cfg.host}:{cfg.port}")
    await server.start()
    server._specdec_executor = executor  # shut down with the server
    server._specdec_servicer = servicer
    return server, port


async def stop_server(server, grace: float = GRACE_SECONDS) -> None:
    await server.stop(grace)
    server._specdec_executor.shutdown(wait=False, cancel_futures=True)


async def serve(cfg: EdgeConfig) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then stop gracefully."""
    target = load_model(cfg.model)
    metrics = EdgeMetrics()
    metrics.set_model(target.name, target.vocab_size)
    if cfg.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
    server, port = await start_server(cfg, target, metrics)
    log.info("edge-server ready on %s:%d model=%s vocab=%d", cfg.host, port, target.name, target.vocab_size)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("edge-server shutting down (grace %.0f s)", GRACE_SECONDS)
    await stop_server(server)
