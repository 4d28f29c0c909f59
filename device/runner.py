"""The one-shot device run: load the drafter, open a channel, run sessions, print text or JSON."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
from prometheus_client import start_http_server

from specdec.common.codecs import Mode
from specdec.common.modeling import LoadedModel, ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.common.protocol import DraftSettings, Hello
from specdec.device.client import ConnectionPolicy, GenerationResult, generate
from specdec.device.default_drafter import default_drafter_spec, drafter_meta, has_default_drafter
from specdec.device.drafter import DraftSession
from specdec.device.metrics import DeviceMetrics

# The default drafter for the embedded target ships in device/drafter_weights (default_drafter.py).
# Without those files, or with --draft-layers N, the drafter is the target's own first N layers with
# its final norm and head (early exit): acceptance ~0.1 at 12 layers, self-contained but not fast.
INTERIM_DRAFT_LAYERS = 12
DEFAULT_DRAFT_LEN = 4  # chain length L for drafters that do not record their own best L
DEFAULT_TOP_K = 64     # tslt / ksqs K for drafters that do not record their own (the papers' range)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # same bound as the edge (dense fp32 rounds over big vocabularies)


@dataclass(frozen=True)
class DeviceConfig:
    edge: str = "127.0.0.1:50051"       # edge HOST:PORT
    prompt: str = ""
    raw: bool = False                   # skip the chat template
    draft_model: str | None = None      # HF dir / hub id; None = interim embedded drafter
    draft_gguf_file: str | None = None
    draft_layers: int | None = None     # keep the first N drafter layers
    device: str = "cpu"
    dtype: str = "float32"
    mode: Mode = Mode.TSLT
    top_k: int | None = None            # tslt / ksqs K; None = the default drafter's recorded K, else 64
    top_p: float = 0.0
    lattice: int = 1000
    dense_dtype: str = "fp16"
    csqs_alpha: float = 0.01
    csqs_eta: float = 0.001
    csqs_beta0: float = 0.001
    max_k: int = 4096
    dssd_samples: int = 8
    tree: tuple[int, ...] = ()          # token tree expansion configuration; () = chain
    draft_len: int | None = None        # chain length L; None = the default drafter's recorded best, else 4
    draft_ahead: bool = True            # draft the next round while the edge verifies (chain rounds)
    coupled_bonus: bool = True          # chain rounds outside DSSD: the edge draws the bonus token with
                                        # noise the device can compute, so drafting ahead guesses it at T > 0
    bit_budget: int = 0
    temperature: float = 0.0
    target_top_p: float = 0.0
    target_top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128
    num_samples: int = 1
    timeout: float = 600.0              # seconds per session
    json: bool = False
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"     # /metrics bind address (0.0.0.0 where Prometheus is on another host)
    linger: float = 0.0                 # seconds /metrics stays up after the last session (final scrape)
    tls_ca: str | None = None           # PEM CA that signed the edge's certificate (enables TLS)
    tls_cert: str | None = None         # PEM client certificate (mutual TLS)
    tls_key: str | None = None          # PEM key of tls_cert
    tls_server_name: str | None = None  # name to verify in the edge's certificate, if not the host
    auth_token_file: str | None = None  # bearer token sent with every session
    round_timeout: float = 30.0         # a verdict later than this = dead link: reconnect and resume
    reconnect_timeout: float = 60.0     # give up after this long without a working stream

    def uses_default_drafter(self) -> bool:
        return (self.draft_model is None and self.draft_gguf_file is None and self.draft_layers is None
                and has_default_drafter())

    def effective_draft_len(self) -> int:
        """--draft-len if given; else the L recorded with the default drafter, else DEFAULT_DRAFT_LEN."""
        return self._operating_point("draft_len", self.draft_len, DEFAULT_DRAFT_LEN)

    def effective_top_k(self) -> int:
        """--top-k if given; else the K recorded with the default drafter (its T = 1 acceptance
        through TSLT grows with K: drafter_weights/README.md), else DEFAULT_TOP_K."""
        return self._operating_point("top_k", self.top_k, DEFAULT_TOP_K)

    def _operating_point(self, key: str, given: int | None, fallback: int) -> int:
        if given is not None:
            return given
        if self.uses_default_drafter():
            return int(drafter_meta().get(key, fallback))
        return fallback

    def model_spec(self) -> ModelSpec:
        if self.uses_default_drafter():
            return default_drafter_spec(self.device, self.dtype)
        if self.draft_model is None and self.draft_gguf_file is None:
            layers = self.draft_layers or INTERIM_DRAFT_LAYERS
            return ModelSpec(device=self.device, dtype=self.dtype, num_layers=layers)
        return ModelSpec(model=self.draft_model, gguf_file=self.draft_gguf_file, device=self.device,
                         dtype=self.dtype, num_layers=self.draft_layers)

    def hello(self, fingerprint: str, vocab_size: int, seed: int) -> Hello:
        settings = DraftSettings(
            draft_len=self.effective_draft_len(), bit_budget=self.bit_budget,
            top_k=min(self.effective_top_k(), vocab_size), top_p=self.top_p, lattice=self.lattice,
            dense_dtype=self.dense_dtype,
            csqs_alpha=self.csqs_alpha, csqs_eta=self.csqs_eta, csqs_beta0=self.csqs_beta0,
            max_k=self.max_k, dssd_samples=self.dssd_samples, tree=tuple(self.tree),
            coupled_bonus=self.coupled_bonus and not self.tree and self.mode is not Mode.DSSD)
        return Hello(mode=self.mode, vocab_fingerprint=fingerprint, vocab_size=vocab_size,
                     temperature=self.temperature, draft=settings, seed=seed,
                     max_new_tokens=self.max_new_tokens, target_top_p=self.target_top_p,
                     target_top_k=self.target_top_k)


    def policy(self) -> ConnectionPolicy:
        metadata = ()
        if self.auth_token_file:
            metadata = (("authorization", f"Bearer {read_token(self.auth_token_file)}"),)
        return ConnectionPolicy(round_timeout_s=self.round_timeout, reconnect_timeout_s=self.reconnect_timeout,
                                metadata=metadata)

    def channel(self, extra_options: tuple = ()) -> grpc.aio.Channel:
        tls = None
        if self.tls_ca or self.tls_cert:
            tls = ClientTls(ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key, server_name=self.tls_server_name)
        return open_channel(self.edge, extra_options, tls=tls)


def read_token(path: str | Path) -> str:
    """The device's bearer token: the first non-comment line of its token file."""
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise ValueError(f"no token in {path}")


@dataclass(frozen=True)
class ClientTls:
    ca: str | None                # PEM roots; None = the system's
    cert: str | None = None       # PEM client certificate chain (mutual TLS)
    key: str | None = None
    server_name: str | None = None


# Device side of HTTP/2 keepalive (the edge permits pings this often): a silent dead link is
# noticed within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS even while no round is in flight.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; a device resuming a session after a
# short outage should retry sooner.
RECONNECT_BACKOFF_MS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                        ("grpc.max_reconnect_backoff_ms", 2_000))


def open_channel(address: str, extra_options: tuple = (), tls: ClientTls | None = None) -> grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
               ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
               *RECONNECT_BACKOFF_MS, *extra_options]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca).read_bytes() if tls.ca else None,
        private_key=Path(tls.key).read_bytes() if tls.key else None,
        certificate_chain=Path(tls.cert).read_bytes() if tls.cert else None)
    return grpc.aio.secure_channel(address, creds, options=options)


def result_json(cfg: DeviceConfig, drafter: LoadedModel, session: DraftSession, r: GenerationResult) -> dict:
    s = session.stats
    text = drafter.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    n = len(r.token_ids)
    return {
        "token_ids": r.token_ids,
        "text": text,
        "mode": cfg.mode.value,
        "draft_model": drafter.name,
        "edge_model": r.welcome.model_name,
        "stats": {
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "draft_positions": s.draft_positions,
            "acceptance_rate": s.accepted_tokens / s.draft_positions if s.draft_positions else 0.0,
            "mean_accepted_length": s.accepted_tokens / s.rounds if s.rounds else 0.0,
            # per-token acceptance alpha (the papers' i.i.d. alpha, eq. 8): accepted / positions tested
            "positions_verified": s.positions_verified,
            "token_acceptance_rate": s.accepted_tokens / s.positions_verified if s.positions_verified else 0.0,
            "accepted_per_position": s.accepted_per_position,
            "drafted_per_position": s.drafted_per_position,
            "draft_ahead": {"rounds_used": s.ahead_rounds_used, "tokens_used": s.ahead_tokens_used,
                            "tokens_discarded": s.ahead_tokens_discarded},
            "acceptance_per_depth": [a / d if d else 0.0 for a, d in
                                     zip(s.accepted_per_position, s.drafted_per_position)],
            "tree": list(cfg.tree),
            "tree_nodes_sent": s.draft_tokens if cfg.tree else 0,
            "generated_tokens": n,
            "uplink_bytes": r.uplink_bytes,
            "downlink_bytes": r.downlink_bytes,
            "setup_bytes": r.setup_bytes,
            "uplink_bytes_per_token": r.uplink_bytes / n if n else 0.0,
            "theoretical_uplink_bits": s.theoretical_uplink_bits,
            "dssd_fallbacks": r.dssd_fallbacks,
            "wall_seconds": r.wall_seconds,
            "tokens_per_second": n / r.wall_seconds if r.wall_seconds > 0 else 0.0,
            "time": {"draft": s.draft_seconds, "encode": s.encode_seconds,
                     "network": r.network_seconds, "verify": r.verify_seconds},
        },
    }


class _TextStreamer:
    """Prints verified text as it arrives (decode-all-and-diff handles multi-token characters)."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


async def run_device(cfg: DeviceConfig, out: TextIO) -> list[dict]:
    """Load the drafter, run ``num_samples`` sessions, write text or JSON lines to ``out``."""
    drafter = await asyncio.to_thread(load_model, cfg.model_spec())
    prompt_ids = encode_prompt(drafter.tokenizer, cfg.prompt, raw=cfg.raw)
    fingerprint = vocab_fingerprint(drafter.tokenizer)
    metrics = DeviceMetrics()
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=metrics.registry)
    results = []
    policy = cfg.policy()
    async with cfg.channel() as channel:
        for i in range(cfg.num_samples):
            hello = cfg.hello(fingerprint, drafter.vocab_size, seed=cfg.seed + i)
            session = DraftSession(drafter, hello, draft_ahead=cfg.draft_ahead)
            streamer = None if cfg.json else _TextStreamer(drafter.tokenizer, out)
            r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids,
                               on_tokens=streamer, timeout=cfg.timeout, metrics=metrics, policy=policy)
            record = result_json(cfg, drafter, session, r)
            results.append(record)
            out.write(json.dumps(record) + "\n" if cfg.json else "\n")
            out.flush()
    if cfg.metrics_port and cfg.linger > 0:
        # A one-shot run can end between two scrapes; stay up so the last counts get scraped.
        await asyncio.sleep(cfg.linger)
    return results
