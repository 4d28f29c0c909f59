"""`device-client serve`: the device as a long-running daemon with an OpenAI-compatible HTTP API.

One process keeps the drafter loaded, one grpc.aio channel open to each edge of ``--edge`` (gRPC
reconnects them by itself after an edge restart; a request whose edge fails continues on another,
device/fleet.py) and its Prometheus metrics exported, and serves ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (aiohttp, on the same uvloop as gRPC).
Every choice of every request is its own edge session run by :func:`specdec.device.client.generate`,
the same engine as the one-shot command; a client that disconnects cancels its handler
(``handler_cancellation``), which ends its sessions between rounds with a Close, so the edge frees
both KV caches at once.
Request parsing and response shapes live in :mod:`specdec.device.openai_schema`.

The daemon holds the device's edge credentials, so whoever reaches its port spends them: with
``--api-key`` (or a key file) every endpoint but ``/health`` wants ``Authorization: Bearer <key>``,
compared in constant time, and answers 401 in OpenAI's shape otherwise. Listening beyond loopback
without a key is refused unless explicitly allowed (:func:`check_exposure`).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from specdec.common import protocol as P
from specdec.common.modeling import LoadedModel, chat_ids, encode_prompt, load_model, vocab_fingerprint
from specdec.common.runtime import is_loopback
from specdec.common.grammar import GrammarError, GrammarState
from specdec.common.logprobs import NO_LOGPROBS
from specdec.device.tools import CallGuard, with_tools
from specdec.common.modes import Mode
from specdec.device import openai_schema
from specdec.device.client import EdgeError, generate
from specdec.device.detokenize import Detokenizer
from specdec.device.fleet import Fleet
from specdec.device.metrics import DeviceMetrics
from specdec.device.openai_schema import ApiError, Choice
from specdec.device.factory import (DeviceConfig, choose_drafter, connection_policy, device_tracker, edge_fleet,
                                    new_session, remember)

log = logging.getLogger("specdec.device.daemon")

GRACE_SECONDS = 5.0           # in-flight requests get this long to finish on SIGTERM
MAX_BODY_BYTES = 8 * 1024 * 1024  # long chat histories fit; anything larger is not a prompt
SEED_MODULUS = 2**63          # per-choice seeds are seed + index, kept inside the drafter's range
CANCEL_GRACE_S = 2.0          # an abandoned session gets this long to reach a round boundary and close
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # reverse proxies must not buffer the token stream

# Edge statuses -> (HTTP status, OpenAI error type). The request's own fault is 400; an edge that is
# full or away is 503 (retry later) and one that ran out of time 504. The edge refusing the daemon's
# credentials (UNAUTHENTICATED, PERMISSION_DENIED) is the daemon's configuration failing upstream, not
# the client's key (the daemon answers that with 401 itself): 502, as is anything else the edge says.
_EDGE_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "server_error"),
    grpc.StatusCode.PERMISSION_DENIED: (502, "server_error"),
}


@dataclass(frozen=True)
class DaemonConfig:
    device: DeviceConfig = field(default_factory=DeviceConfig)  # edge, drafter, draft/mode and sampling defaults
    host: str = "127.0.0.1"       # HTTP API bind address (metrics bind to device.metrics_host)
    port: int = 8000              # 0 = pick a free port
    model_name: str = "specdec"   # the id /v1/models lists and responses echo when a request names none
    connect_timeout: float = 3.0  # seconds to wait for the edge connection before answering 503
    api_key: str | None = None    # required as "Authorization: Bearer <key>" on every endpoint but /health
    allow_no_api_key: bool = False  # listen beyond loopback without a key (anyone who reaches the port
                                    # spends the device's edge credentials)
    chat_template: str | None = None  # replaces the drafter tokenizer's chat template (Jinja text), as vLLM's flag

    def __repr__(self) -> str:  # never print the key
        return f"DaemonConfig(host={self.host!r}, port={self.port}, api_key={'set' if self.api_key else None})"


class ExposureError(ValueError):
    """The daemon would listen beyond loopback with no API key, and that was not explicitly allowed."""


def check_exposure(cfg: DaemonConfig) -> None:
    """Refuse (ExposureError) to listen beyond loopback without an API key unless allowed; when
    allowed, warn loudly. The daemon spends the device's edge credentials for whoever calls it."""
    if cfg.api_key or is_loopback(cfg.host):
        return
    if not cfg.allow_no_api_key:
        raise ExposureError(f"listening on {cfg.host} without an API key would let anyone who reaches the port "
                            "use this device's edge credentials: give --api-key or --api-key-file (or "
                            "--allow-no-api-key to do it anyway)")
    log.warning("NO API KEY on %s:%d: anyone who reaches this port can use the device's edge credentials",
                cfg.host, cfg.port)


class HttpMetrics:
    """``specdec_device_http_*``: requests by route and status, requests in flight.

    Error ratio: ``sum(rate(specdec_device_http_requests_total{status=~"5.."}[5m])) /
    sum(rate(specdec_device_http_requests_total[5m]))``
    """

    def __init__(self, registry: CollectorRegistry):
        kw = dict(namespace="specdec", subsystem="device_http", registry=registry)
        self.requests = Counter("requests", "HTTP API requests by route and status", ["route", "status"], **kw)
        self.in_flight = Gauge("requests_in_flight", "HTTP API requests being answered", **kw)


# -- the engine: what lives as long as the daemon --------------------------------------------------
class _StopStringSeen(Exception):
    """Raised from the token callback: ends the session at a stop string (generate closes it)."""


class _ClientGone(asyncio.CancelledError):
    """Raised from the token callback once the request is abandoned: the session ends between two
    rounds, where generate can still deliver its Close, so the edge frees the session at once. A
    cancel that lands in a pending read cancels the RPC instead (grpc.aio does so), and the edge then
    keeps the session for a resume that never comes."""


class _TextTracker:
    """Verified token ids -> text deltas (decoded incrementally: device/detokenize.py), holding back
    any tail that could still become a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = stops
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.text = ""          # the answer so far, cut before a stop string once one appears
        self.sent = 0           # characters of `text` already handed out
        self.stopped = False
        self._searched = 0      # characters of `text` already searched for stop strings

    @property
    def ids(self) -> list[int]:
        return self.detokenizer.ids

    def add(self, new: list[int]) -> str:
        self.text += self.detokenizer.add(new)
        start = max(0, self._searched - self.longest_stop + 1)  # a match may straddle the old end
        self._searched = len(self.text)
        cut = openai_schema.find_stop(self.text[start:], self.stops)
        if cut >= 0:
            self.text, self.stopped = self.text[:start + cut], True
            return self._take(len(self.text))
        return self._take(openai_schema.safe_length(self.text, self.stops))

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta


def edge_api_error(exc: EdgeError) -> ApiError:
    status, kind = _EDGE_STATUS.get(exc.code, (502, "server_error"))
    return ApiError(status, f"edge: {exc.code.name}: {exc.details}", type=kind, code=exc.code.name.lower())


def request_config(base: DeviceConfig, p: openai_schema.SamplingParams) -> DeviceConfig:
    """The daemon's defaults with this request's sampling parameters and `specdec` overrides."""
    target_top_p = base.target_top_p if p.top_p is None else (0.0 if p.top_p >= 1.0 else p.top_p)
    target_top_k = base.target_top_k if p.top_k is None else max(p.top_k, 0)
    return replace(base, draft={**base.draft, **p.overrides},
                   temperature=base.temperature if p.temperature is None else p.temperature,
                   target_top_p=target_top_p, target_top_k=target_top_k,
                   target_min_p=base.target_min_p if p.min_p is None else p.min_p,
                   adjust=p.adjust if p.adjust.active else base.adjust,
                   grammar=p.grammar if p.grammar is not None else base.grammar, logprobs=p.logprobs,
                   max_new_tokens=p.max_tokens or base.max_new_tokens,
                   ignore_eos=base.ignore_eos if p.ignore_eos is None else p.ignore_eos,
                   # a request without a seed gets a fresh one: nothing to reproduce
                   reproducible=base.reproducible and p.seed is not None)


class DeviceEngine:
    """The drafter, the edges (one channel each) and the metrics; runs one choice as one edge session."""

    def __init__(self, cfg: DaemonConfig, drafter: LoadedModel, fleet: Fleet,
                 metrics: DeviceMetrics, operating_point: Mapping[str, Any] = ()):
        self.cfg = cfg
        self.drafter = drafter
        self.fleet = fleet
        self.metrics = metrics
        self.fingerprint = vocab_fingerprint(drafter.tokenizer)
        self.policy = connection_policy(cfg.device)  # auth metadata, round timeout, resume after a broken stream
        self.operating_point = operating_point  # the drafter's recorded draft settings
        self.tracker = device_tracker(cfg.device, drafter)  # mode auto: what the device knows of its link
        self.started = int(time.time())

    async def check_edge(self) -> None:
        """Answer 503 within ``connect_timeout`` rather than queue behind unreachable edges."""
        if not await self.fleet.ready(self.cfg.connect_timeout):
            states = ", ".join(f"{t} {state}" for t, state in self.fleet.states().items())
            raise ApiError(503, f"edge {self.cfg.device.edge} is unreachable ({states} after "
                           f"{self.cfg.connect_timeout:g} s)", type="server_error",
                           code="edge_unavailable")

    def settings(self, p: openai_schema.SamplingParams) -> DeviceConfig:
        cfg = request_config(self.cfg.device, p)
        try:
            cfg.adjust.check(self.drafter.vocab_size)
        except ValueError as exc:
            raise openai_schema.bad(str(exc), "logit_bias") from None
        if cfg.logprobs != NO_LOGPROBS and cfg.draft.get("mode") is Mode.DSSD:
            raise openai_schema.bad("mode dssd draws its corrections on the device: it gives no logprobs", "logprobs")
        if cfg.grammar is not None:  # compiled here (cached): a grammar the engine refuses is the client's 400
            try:
                GrammarState(cfg.grammar, self.drafter.tokenizer, self.drafter.vocab_size, self.drafter.eos_token_ids)
            except GrammarError as exc:
                raise openai_schema.bad(f"grammar: {exc}", "response_format") from None
        return cfg

    def encode_text(self, text: str) -> list[int]:
        ids = encode_prompt(self.drafter.tokenizer, text, raw=True)
        if not ids:
            raise openai_schema.bad("the prompt encodes to no tokens", "prompt")
        return ids

    def check_ids(self, ids: tuple[int, ...]) -> list[int]:
        if not all(0 <= t < self.drafter.vocab_size for t in ids):
            raise openai_schema.bad(f"prompt token ids must be in [0, {self.drafter.vocab_size})", "prompt")
        return list(ids)

    def encode_chat(self, messages: tuple[dict, ...], tools: tuple = ()) -> list[int]:
        """The conversation through the chat template; ``tools`` through its tools section where it has
        one, else stated in a system message (device/tools.py)."""
        tok = self.drafter.tokenizer
        template = self.cfg.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise openai_schema.bad("the drafter's tokenizer has no chat template; use /v1/completions", "messages")
        takes_tools = "tools" in template
        conversation = with_tools(list(messages), tools, takes_tools)
        kw = {"tools": [t.as_openai() for t in tools]} if tools and takes_tools else {}
        try:
            return chat_ids(tok, conversation, chat_template=self.cfg.chat_template, **kw)
        except Exception as exc:  # the template's own checks (role order, ...) reject the conversation
            raise openai_schema.bad(f"chat template: {exc}", "messages") from None

    async def run_choice(self, cfg: DeviceConfig, prompt_ids: list[int], seed: int, index: int,
                         stops: tuple[str, ...], emit: Callable[[int, str, dict | None], None] | None,
                         abandon: asyncio.Event, chat: bool = True) -> Choice:
        """One edge session; verified text goes to ``emit(index, delta, logprobs)`` as soon as it is safe
        to show (``logprobs``: the OpenAI-shaped log-probabilities of the tokens since the last delta,
        if asked; ``chat`` picks the shape).

        Setting ``abandon`` ends the session at its next round boundary (:class:`_ClientGone`).
        """
        hello = cfg.hello(self.fingerprint, self.drafter.vocab_size, seed=seed,
                          operating_point=self.operating_point)
        session = new_session(cfg, self.drafter, hello, self.tracker)
        text = _TextTracker(self.drafter.tokenizer, stops)
        shape = _logprob_shape(chat, self.drafter.tokenizer) if hello.logprobs != NO_LOGPROBS else None
        held: list = []   # (token, TokenLogprob) of tokens whose text is not out yet

        def on_tokens(new: list[int]) -> None:
            if abandon.is_set():
                raise _ClientGone
            done = len(text.ids)
            delta = text.add(new)
            if shape is not None:
                held.extend(zip(new, session.logprobs[done:done + len(new)]))
            if delta and emit:
                emit(index, delta, shape(held) if shape is not None else None)
                held.clear()
            if text.stopped:
                raise _StopStringSeen

        try:
            await generate(self.fleet, session, hello, prompt_ids, self.drafter.eos_token_ids,
                           on_tokens=on_tokens, timeout=cfg.timeout, metrics=self.metrics, policy=self.policy)
        except _StopStringSeen:
            pass
        except EdgeError as exc:
            # The edge's context filling up mid-answer: the answer ends at the length limit, as the
            # target alone would have to. Any other error (an admission refusal when a broken stream
            # re-creates the session, too), or one before any token, is a real failure.
            if exc.reason != P.CONTEXT_FULL or not text.ids:
                raise edge_api_error(exc) from None
            log.info("choice %d ended at the edge's limit after %d tokens: %s", index, len(text.ids), exc.details)
        if cfg.auto:
            await asyncio.to_thread(remember, cfg, self.drafter, self.tracker)
        tail = text.flush()
        if (tail or held) and emit:
            emit(index, tail, shape(held) if shape is not None else None)
        eos = bool(text.ids) and text.ids[-1] in self.drafter.eos_token_ids and not cfg.ignore_eos
        reason = "stop" if text.stopped or eos else "length"
        logprobs = shape(list(zip(text.ids, session.logprobs))) if shape is not None else None
        return Choice(index, text.text, text.ids, reason, session.stats.summary(), logprobs)


def _logprob_shape(chat: bool, tokenizer):
    """(token, TokenLogprob) pairs -> OpenAI's logprobs object of a chat or a completion choice."""
    def decode(token: int) -> str:
        return tokenizer.decode([token])
    if chat:
        return lambda entries: openai_schema.chat_logprobs(entries, decode)
    return lambda entries: openai_schema.completion_logprobs(entries, decode)


# -- HTTP ------------------------------------------------------------------------------------------
ENGINE = web.AppKey("engine", DeviceEngine)
HTTP_METRICS = web.AppKey("http_metrics", HttpMetrics)


def _error_response(exc: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="specdec"'} if exc.status == 401 else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape, and every request is counted by route and status."""
    metrics = request.app[HTTP_METRICS]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
    status = 500
    metrics.in_flight.inc()
    try:
        response = await handler(request)
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        return _error_response(exc)
    except web.HTTPException as exc:  # routing: unknown path 404, wrong method 405
        status = exc.status
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error_response(ApiError(exc.status, exc.reason, type=kind))
    except Exception:  # a bug: still answered in OpenAI's shape (streams handle theirs in _stream)
        log.exception("request to %s failed", route)
        return _error_response(ApiError(500, "internal error", type="server_error"))
    finally:
        metrics.in_flight.dec()
        metrics.requests.labels(route, str(status)).inc()


UNAUTHENTICATED_PATHS = ("/health",)  # a load balancer's or orchestrator's probe carries no key


def api_key_middleware(api_key: str):
    """Every route but UNAUTHENTICATED_PATHS wants ``Authorization: Bearer <api_key>``; the digests are
    compared in constant time (no early exit on the first differing byte, nor on the length)."""
    expected = hashlib.sha256(api_key.encode()).digest()

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path in UNAUTHENTICATED_PATHS:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        if not hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), expected):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)
    return check_key


async def _json_body(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise openai_schema.bad("the request body is not valid JSON") from None


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    meta = {"draft_model": engine.drafter.name, "edge": engine.cfg.device.edge}
    return web.json_response(openai_schema.models_response(engine.cfg.model_name, engine.started, meta))


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = openai_schema.parse_completion(await _json_body(request))
    prompts = [engine.encode_text(p) if isinstance(p, str) else engine.check_ids(p) for p in req.prompts]
    return await _respond(request, req.params, prompts, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = openai_schema.parse_chat(await _json_body(request))
    prompts = [engine.encode_chat(req.messages, req.tools)]
    return await _respond(request, req.params, prompts, chat=True, tools=req.tool_choice != "none")


async def _health(request: web.Request) -> web.Response:
    await request.app[ENGINE].check_edge()
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ENGINE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _respond(request: web.Request, p: openai_schema.SamplingParams, prompts: list[list[int]], *,
                   chat: bool, tools: bool = False) -> web.StreamResponse:
    """Run prompts x n choices (choice index = prompt * n + j, OpenAI's order), answer JSON or SSE.
    With ``tools`` each answer's calls are parsed out (a stream shows the text while it cannot be a
    call, and sends the calls and what was held back when the answer is whole)."""
    engine = request.app[ENGINE]
    cfg = await asyncio.to_thread(engine.settings, p)  # a grammar compiles there: off the loop
    await engine.check_edge()
    seed = secrets.randbits(63) if p.seed is None else p.seed
    model = p.model or engine.cfg.model_name
    rid = openai_schema.new_id("chatcmpl" if chat else "cmpl")
    prompt_tokens = sum(len(ids) for ids in prompts)
    jobs = [(i * p.n + j, ids) for i, ids in enumerate(prompts) for j in range(p.n)]

    def start(emit) -> _Choices:
        return _Choices([lambda abandon, index=index, ids=ids: engine.run_choice(
            cfg, ids, (seed + index) % SEED_MODULUS, index, p.stop, emit, abandon, chat) for index, ids in jobs])

    if p.stream:
        maker = openai_schema.ChunkMaker(rid, model, chat, p.include_usage)
        return await _stream(request, maker, start, [index for index, _ in jobs], prompt_tokens, tools)
    choices = await start(None).results()
    if tools:
        choices = [openai_schema.with_tool_calls(c) for c in choices]
    build = openai_schema.chat_response if chat else openai_schema.completion_response
    return web.json_response(build(rid, model, choices, prompt_tokens))


class _Choices:
    """The edge sessions of one request, one task each, stopped together.

    Stopping (client gone, or a sibling failed) sets ``abandon`` so each session ends at its next
    round boundary and closes cleanly; what still runs after CANCEL_GRACE_S is cancelled outright.
    Waiting uses asyncio.wait, which, unlike gather, never hard-cancels the sessions when the
    request's own task is cancelled.
    """

    def __init__(self, makers: list):
        self.abandon = asyncio.Event()
        self.tasks = [asyncio.ensure_future(make(self.abandon)) for make in makers]

    async def results(self) -> list[Choice]:
        try:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await self.stop()
        for t in self.tasks:  # the first real failure, not a sibling stopped because of it
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in self.tasks]

    async def stop(self) -> None:
        self.abandon.set()
        pending = [t for t in self.tasks if not t.done()]
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
        for t in late:
            t.cancel()
        if late:
            await asyncio.wait(late)


async def _send(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


async def _stream(request: web.Request, maker: openai_schema.ChunkMaker, start, indices: list[int],
                  prompt_tokens: int, tools: bool = False) -> web.StreamResponse:
    """SSE: one chunk per verified delta, a finish chunk per choice, optional usage, ``[DONE]``."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()
    choices = start(lambda index, text, logprobs: queue.put_nowait((index, (text, logprobs))))
    for t in choices.tasks:  # a task's deltas are all queued before its completion marker
        t.add_done_callback(lambda t: queue.put_nowait((None, t)))
    try:
        await _pump(resp, maker, queue, indices, prompt_tokens, tools)
    except ConnectionResetError:  # the client left between two chunks: nobody to tell
        return resp
    except ApiError as exc:  # headers are gone: the error travels as an event, as OpenAI's does
        await _send(resp, exc.body())
    except Exception:
        log.exception("stream failed")
        await _send(resp, ApiError(500, "internal error", type="server_error").body())
    finally:
        await choices.stop()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _pump(resp: web.StreamResponse, maker: openai_schema.ChunkMaker, queue: asyncio.Queue, indices: list[int],
                prompt_tokens: int, tools: bool = False) -> None:
    if maker.chat:
        for index in indices:
            await _send(resp, maker.role(index))
    choices: list[Choice] = []
    guards = {index: _GuardedStream() for index in indices} if tools else {}
    while len(choices) < len(indices):
        index, item = await queue.get()
        if index is not None:
            chunk = guards[index].delta(maker, index, *item) if tools else maker.delta(index, *item)
            if chunk is not None:
                await _send(resp, chunk)
            continue
        choice = item.result()  # raises the session's ApiError
        if tools:  # what was held back, its calls apart
            choice, chunks = guards[choice.index].finish(maker, choice)
            for chunk in chunks:
                await _send(resp, chunk)
        choices.append(choice)
        await _send(resp, maker.finish(choice))
    if maker.include_usage:
        await _send(resp, maker.usage(prompt_tokens, sorted(choices, key=lambda c: c.index)))


class _GuardedStream:
    """A chat answer streamed while it may hold tool calls (device/tools.CallGuard): its text while it
    cannot be a call, its logprobs with the text they belong to, the rest and the calls at the end."""

    def __init__(self):
        self.guard = CallGuard()
        self.held: list = []  # logprobs "content" items not sent yet

    def delta(self, maker: openai_schema.ChunkMaker, index: int, text: str, logprobs: dict | None):
        self.held.extend((logprobs or {}).get("content", []))
        shown = self.guard.add(text)
        return maker.delta(index, shown, self._logprobs()) if shown else None

    def finish(self, maker: openai_schema.ChunkMaker, c: Choice) -> tuple[Choice, list[dict]]:
        rest, content, calls = self.guard.finish(c.text)
        done = openai_schema.with_tool_calls(c, (content, calls))
        chunks = [maker.delta(c.index, rest, self._logprobs())] if rest or self.held else []
        if done.tool_calls:
            chunks.append(maker.tool_calls(done))
        return done, chunks

    def _logprobs(self) -> dict | None:
        if not self.held:
            return None
        out, self.held = {"content": self.held, "refusal": None}, []
        return out


def build_app(engine: DeviceEngine, http_metrics: HttpMetrics) -> web.Application:
    key = [api_key_middleware(engine.cfg.api_key)] if engine.cfg.api_key else []
    app = web.Application(middlewares=[_errors, *key], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[HTTP_METRICS] = http_metrics
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def _metrics_app(registry: CollectorRegistry) -> web.Application:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", metrics)
    return app


# -- lifecycle -------------------------------------------------------------------------------------
@dataclass
class RunningDaemon:
    engine: DeviceEngine
    runners: list[web.AppRunner]
    port: int                     # the HTTP API's bound port
    metrics_port: int | None      # the metrics endpoint's bound port, None when off

    async def stop(self) -> None:
        """Stop listening, give in-flight requests GRACE_SECONDS, then close the edge channel."""
        for runner in self.runners:
            await runner.cleanup()
        await self.engine.fleet.close(GRACE_SECONDS)


async def _listen(app: web.Application, host: str, port: int, **kw) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=logging.getLogger("specdec.device.access"),
                           shutdown_timeout=GRACE_SECONDS, **kw)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


async def start_daemon(cfg: DaemonConfig, drafter: LoadedModel | None = None,
                       metrics: DeviceMetrics | None = None) -> RunningDaemon:
    """Load the drafter (unless given), open the edge channels, start the HTTP API and metrics.
    ExposureError before anything is loaded if it would listen beyond loopback without a key."""
    check_exposure(cfg)
    choice = choose_drafter(cfg.device)
    if drafter is None:
        drafter = await asyncio.to_thread(load_model, choice.spec)
    metrics = metrics or DeviceMetrics()
    fleet = edge_fleet(cfg.device)  # TLS and a short reconnect backoff, as the one-shot command's
    engine = DeviceEngine(cfg, drafter, fleet, metrics, choice.operating_point)
    app = build_app(engine, HttpMetrics(metrics.registry))
    # handler_cancellation: a client that goes away cancels its handler, hence its edge sessions.
    api, port = await _listen(app, cfg.host, cfg.port, handler_cancellation=True)
    runners, metrics_port = [api], None
    if cfg.device.metrics_port:
        runner, metrics_port = await _listen(_metrics_app(metrics.registry), cfg.device.metrics_host,
                                             cfg.device.metrics_port)
        runners.append(runner)
    return RunningDaemon(engine, runners, port, metrics_port)


async def serve(cfg: DaemonConfig) -> None:
    """Run the daemon until SIGTERM/SIGINT, then shut down gracefully."""
    daemon = await start_daemon(cfg)
    log.info("device daemon ready on http://%s:%d/v1 edge=%s drafter=%s metrics=%s", cfg.host, daemon.port,
             cfg.device.edge, daemon.engine.drafter.name, daemon.metrics_port or "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("device daemon shutting down (grace %.0f s)", GRACE_SECONDS)
    await daemon.stop()
