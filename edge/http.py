"""The edge's HTTP side, on ``--metrics-port``: Prometheus ``/metrics`` and the probes a load balancer
or Kubernetes asks.

- ``/healthz``: 200 while the process serves (liveness; draining included);
- ``/readyz``: 200 while the edge takes new sessions, 503 with the reason while it drains (SIGTERM) or
  while admission would refuse a new session at once (every slot held, the queue full). A proxy that
  checks it (deploy/haproxy) or a Kubernetes readiness probe stops sending new sessions there; the
  sessions running there carry on.
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def probe_app(registry: CollectorRegistry | None, readiness) -> web.Application:
    """``readiness()`` -> (ready, reason): the session registry's (SessionRegistry.readiness)."""
    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry) if registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        ready, reason = readiness()
        return web.json_response({"status": "ready" if ready else "not ready", "reason": reason},
                                 status=200 if ready else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start_probe_server(host: str, port: int, registry: CollectorRegistry | None,
                             readiness) -> tuple[web.AppRunner, int]:
    """Serve :func:`probe_app` on ``host:port`` (0 = a free port); returns (runner, bound port)."""
    runner = web.AppRunner(probe_app(registry, readiness), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]
