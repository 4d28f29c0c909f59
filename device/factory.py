"""How the device builds its parts from a :class:`DeviceConfig`: the drafter it loads, a session (with
mode auto's controller), mode auto's memory of the link, the connection policy and the channels.
Shared by the one-shot runner (runner.py) and the OpenAI daemon (daemon.py), so that both build a
session the same way."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import grpc

from specdec.common import settings as S
from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.grammar import Grammar
from specdec.common.logprobs import NO_LOGPROBS
from specdec.common.modeling import LoadedModel, ModelSpec
from specdec.common.protocol import Hello
from specdec.common.runtime import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MAX_MESSAGE_BYTES
from specdec.device import edge_memory
from specdec.device.auto import AutoPolicy, LinkTracker
from specdec.device.client import ConnectionPolicy
from specdec.device.fleet import Fleet, Selection, parse_edges
from specdec.device.lean_drafter import default_drafter_spec, drafter_meta, has_default_drafter
from specdec.device.session import DraftSession

log = logging.getLogger("specdec.device")

# The default drafter for the embedded target ships in device/drafter_weights (lean_drafter.py).
# Without those files, or with --draft-layers N, the drafter is the target's own first N layers with
# its final norm and head (early exit): acceptance ~0.1 at 12 layers, self-contained but not fast.
INTERIM_DRAFT_LAYERS = 12


# ``mode auto`` is the default of a session given no draft setting: over the links benchmark's grid it
# runs faster than the fixed default (the drafter's recorded K and L) in every cell (docs/benchmarks.md,
# "Links").
AUTO_BY_DEFAULT = True


@dataclass(frozen=True)
class DeviceConfig:
    edge: str = "127.0.0.1:50051"       # edge HOST:PORT, several (comma-separated) or a gRPC target (dns:///...)
    edge_selection: str = Selection.LEAST_LOADED.value  # which edge of several a new session starts on
    prompt: str = ""
    raw: bool = False                   # skip the chat template
    draft_model: str | None = None      # HF dir / hub id; None = the default (or interim) embedded drafter
    draft_gguf_file: str | None = None
    draft_layers: int | None = None     # keep the first N drafter layers
    device: str = "cpu"
    dtype: str = "float32"
    # Draft settings the user gave, by their names in common/settings.py; the others come from the
    # drafter's recorded operating point (the default drafter records L and K), else the table.
    draft: Mapping[str, Any] = field(default_factory=S.GivenSettings)
    draft_ahead: bool = True            # draft the next round while the edge verifies (chain rounds)
    run_ahead: bool = True              # the edge generates on while a round is overdue (device/run_ahead.py)
    temperature: float = 0.0
    target_top_p: float = 0.0           # 0 = off
    target_top_k: int = 0               # 0 = off
    target_min_p: float = 0.0           # 0 = off
    adjust: LogitAdjust = NO_ADJUST     # logit bias and penalties of the target distribution
    grammar: Grammar | None = None      # what the output must match (structured outputs)
    logprobs: int = NO_LOGPROBS         # the tokens' log-probabilities (0) and their top N (N > 0)
    seed: int = 0
    max_new_tokens: int = 128
    ignore_eos: bool = False            # go on past end-of-sequence tokens to max_new_tokens (Hello.ignore_eos)
    num_samples: int = 1
    timeout: float = 600.0              # seconds per session
    json: bool = False
    metrics_port: int = 0               # 0 = no /metrics
    metrics_host: str = "127.0.0.1"     # /metrics bind address (0.0.0.0 where Prometheus is on another host)
    linger: float = 0.0                 # seconds /metrics stays up after the last session (final scrape)
    tls_ca: str | None = None           # PEM CA that signed the edge's certificate (enables TLS)
    tls_cert: str | None = None         # PEM client certificate (mutual TLS)
    tls_key: str | None = None          # PEM key of tls_cert
    tls_server_name: str | None = None  # name to verify in the edge's certificate, if not the host
    auth_token_file: str | None = None  # bearer token sent with every session
    round_timeout: float = 30.0         # a verdict later than this = dead link: reconnect and resume
    reconnect_timeout: float = 60.0     # give up after this long without a working stream
    round_log: bool = False             # JSON output: one entry per round (settings, counts, times, auto's choice)
    edge_memory: bool = True            # mode auto starts from what this device learned about the edge in
                                        # earlier processes, and keeps it ($SPECDEC_CACHE_DIR/edges)
    # A seeded session at T > 0 gives the same tokens in every run (docs/modes.md, "Same seed, same
    # tokens"): mode auto keeps to rounds whose tokens are the target's own race with the seed's noise
    # (gumbel, edge-only), and fixed modes draft the lengths they were given whatever the edge's load
    # advice. Off: auto may pick any round and fixed modes follow the advice (tokens then depend on
    # the drafter, the load and the link; the law is the same either way).
    reproducible: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.draft, S.GivenSettings):  # hashable, and checked against the table
            object.__setattr__(self, "draft", S.GivenSettings(S.parse_settings(self.draft)))

    @classmethod
    def of(cls, **kw) -> "DeviceConfig":
        """A config from flat keywords: draft settings (``mode``, ``top_k``, ...) go to ``draft``."""
        names = set(S.setting_names())
        draft = {k: v for k, v in kw.items() if k in names}
        return cls(**{k: v for k, v in kw.items() if k not in names}, draft=draft)

    @property
    def auto(self) -> bool:
        """``mode auto``: the device's controller picks every round's settings (device/auto.py). Asked
        for with ``mode auto``; the default of a session given no draft setting (any draft setting
        pins the fixed settings: the user chose them)."""
        return S.wants_auto(self.draft) or (AUTO_BY_DEFAULT and not self.draft)

    def with_draft(self, **settings) -> "DeviceConfig":
        """The same config with these draft settings given as well (checked: ValueError)."""
        return replace(self, draft={**self.draft, **S.parse_settings(settings)})

    def hello(self, fingerprint: str, vocab_size: int, seed: int,
              operating_point: Mapping[str, Any] = ()) -> Hello:
        """The session's Hello; ``operating_point``: the drafter's recorded settings (:func:`choose_drafter`)."""
        return Hello(vocab_fingerprint=fingerprint, vocab_size=vocab_size, temperature=self.temperature,
                     draft=S.resolve(self.draft, operating_point, vocab_size), seed=seed,
                     max_new_tokens=self.max_new_tokens, target_top_p=self.target_top_p,
                     target_top_k=self.target_top_k, target_min_p=self.target_min_p, adjust=self.adjust,
                     grammar=self.grammar, logprobs=self.logprobs, ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class DrafterChoice:
    spec: ModelSpec                     # what to load
    operating_point: Mapping[str, Any]  # its recorded draft settings (the default drafter's L and K)


def choose_drafter(cfg: DeviceConfig) -> DrafterChoice:
    """Which drafter ``cfg`` asks for; reads the default drafter's record once (I/O)."""
    if cfg.draft_model is None and cfg.draft_gguf_file is None and cfg.draft_layers is None \
            and has_default_drafter():
        return DrafterChoice(default_drafter_spec(cfg.device, cfg.dtype), drafter_meta())
    if cfg.draft_model is None and cfg.draft_gguf_file is None:
        layers = cfg.draft_layers or INTERIM_DRAFT_LAYERS
        return DrafterChoice(ModelSpec(device=cfg.device, dtype=cfg.dtype, num_layers=layers), {})
    return DrafterChoice(ModelSpec(model=cfg.draft_model, gguf_file=cfg.draft_gguf_file, device=cfg.device,
                                   dtype=cfg.dtype, num_layers=cfg.draft_layers), {})


def new_session(cfg: DeviceConfig, drafter: LoadedModel, hello: Hello,
                tracker: LinkTracker | None = None, session_class=DraftSession) -> DraftSession:
    """A session for ``hello``; with ``mode auto``, driven by a controller that learns from ``tracker``
    (one per device: its sessions share the link, and the round trips that time the edge's running
    ahead)."""
    policy = None
    if cfg.auto:
        tracker = tracker or LinkTracker()
        policy = AutoPolicy(tracker, hello, drafter.vocab_size, draft_ahead=cfg.draft_ahead,
                            reproducible=cfg.reproducible)
    return session_class(drafter, hello, draft_ahead=cfg.draft_ahead, policy=policy, round_log=cfg.round_log,
                         reproducible=cfg.reproducible, run_ahead=cfg.run_ahead,
                         overdue=tracker.overdue if tracker is not None else None)


def device_tracker(cfg: DeviceConfig, drafter: LoadedModel) -> LinkTracker:
    """Mode auto's memory of the link for this device's sessions: from what earlier processes learned
    about ``cfg.edge`` with this drafter (device/edge_memory.py), unless ``cfg.edge_memory`` is off."""
    tracker = LinkTracker()
    if cfg.edge_memory:
        restored = edge_memory.load(tracker, cfg.edge, drafter.name)
        if restored:
            log.info("mode auto starts from what this device remembers of %s: %s", cfg.edge, ", ".join(restored))
    return tracker


def remember(cfg: DeviceConfig, drafter: LoadedModel, tracker: LinkTracker) -> None:
    """Keep what ``tracker`` learned for later processes (after each session: I/O)."""
    if cfg.edge_memory and tracker.rounds_seen:
        edge_memory.save(tracker, cfg.edge, drafter.name)


def connection_policy(cfg: DeviceConfig) -> ConnectionPolicy:
    """Reconnect policy and call metadata; reads the bearer token file (I/O)."""
    metadata = ()
    if cfg.auth_token_file:
        metadata = (("authorization", f"Bearer {read_token(cfg.auth_token_file)}"),)
    return ConnectionPolicy(round_timeout_s=cfg.round_timeout, reconnect_timeout_s=cfg.reconnect_timeout,
                            metadata=metadata)


def edge_channel(cfg: DeviceConfig, extra_options: tuple = ()) -> grpc.aio.Channel:
    """A channel to ``cfg.edge`` (TLS when a CA or client certificate is given); call in a coroutine."""
    return open_channel(cfg.edge, extra_options, tls=client_tls(cfg))


def edge_fleet(cfg: DeviceConfig) -> Fleet:
    """The edges ``cfg.edge`` names (device/fleet.py), one channel each, TLS as for one edge; call in
    a coroutine. ValueError if ``cfg.edge`` is malformed."""
    tls = client_tls(cfg)
    return Fleet(parse_edges(cfg.edge), lambda target, options: open_channel(target, options, tls=tls),
                 Selection(cfg.edge_selection))


def client_tls(cfg: DeviceConfig) -> "ClientTls | None":
    if cfg.tls_ca or cfg.tls_cert:
        return ClientTls(ca=cfg.tls_ca, cert=cfg.tls_cert, key=cfg.tls_key, server_name=cfg.tls_server_name)
    return None


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


# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; a device resuming a session after a
# short outage should retry sooner. gRPC core also reads min_reconnect_backoff_ms as the least time a
# connection attempt gets to finish its HTTP/2 handshake (default 20 s): at 200 ms a loaded host's
# edge could not answer SETTINGS in time and the first call failed UNAVAILABLE; 5 s leaves room.
RECONNECT_BACKOFF_MS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 5_000),
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
