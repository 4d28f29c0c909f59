"""Domain types of the wire contract (``proto/specdec/v1``), free of protobuf.

The servicer and the client convert protobuf messages to these dataclasses with
:mod:`specdec.common.wire` and hand them to the engines, which never see ``*_pb2``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.grammar import Grammar
from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob
from specdec.common.modes import Mode
from specdec.common.settings import DraftSettings

# Version 1 still: per-round settings (Draft.settings) and DraftSettings.mode are additions that a
# device which never sends them does not notice, and an edge which ignores them is never sent them.
# So is the DSSD head fallback: an older device leaves dssd_fallback_top_k at 0 and gets the whole
# p_j; an older edge ignores it (and ResidualRequest.whole) and sends the whole p_j, which a newer
# device reads as such; an older edge's Welcome has no dssd_max_samples (0: its cap was 64).
# So are the fleet fields: an older edge ignores Hello.target_fingerprint and leaves Welcome's
# target_fingerprint and edge_name empty, which a newer device reads as "not said"; and End, which an
# edge sends only to a device that asked for it (Hello.wants_end).
# So is mode gumbel: a device sends gumbel rounds only to an edge whose Welcome lists MODE_GUMBEL in
# `modes` (mode auto leaves it out of its candidates otherwise); an older edge refuses a Hello or a
# Draft naming mode 7 with INVALID_ARGUMENT ("unknown or unspecified draft mode 7"), and never sees
# packed_ids. An edge that lists it draws mode none's tokens by the same race as gumbel rounds (an
# older one by inverse CDF: the same law, other tokens), so a session that moves between the two
# keeps its law but not its tokens.
# So are min-p, logit bias, penalties and a grammar (Hello.target_min_p, .adjust, .grammar): an older edge ignores
# them and says nothing of them in its Welcome, and a device whose Hello sets any stops there
# (Welcome.adjusts_law), before any round; Prompt.prompt_len, which only such an edge reads.
# So is a late round continued (Hello.continues_late): an older edge supersedes the round, as the
# device expects of it, and an older device is never sent a verdict after tokens generated ahead; so is
# a late edge-only round continued (Hello.continues_late_edge_only), each way alike.
PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION", "DraftSettings", "Hello", "Welcome", "DraftBlock", "Verdict",
           "ResidualReply", "ResidualRequest", "Prompt", "Close", "End"]


# Why the edge ended a session, machine-readable, in the trailing metadata under REASON_KEY (a
# status's details are for people): a device tells a full context, where an answer ends at its
# length limit, from a refusal such as admission's (principal_cap, queue_full, queue_timeout).
REASON_KEY = "specdec-reason"
CONTEXT_FULL = "context_full"
# The edge is draining (SIGTERM): it takes no new session, and a session still running when its drain
# time is up is ended with UNAVAILABLE and this reason, so the device resumes it on another edge.
DRAINING = "draining"
# A resume on an edge whose target is not the one the session ran on (Hello.target_fingerprint).
TARGET_MISMATCH = "target_mismatch"

# Call metadata naming the session on every stream of it (the first and each resume), chosen by the
# device, so that a proxy in front of several edges can keep a session on the edge that holds its KV
# cache (hash or stick on it). The edge's session id cannot serve: it exists only after the first
# stream has reached an edge.
SESSION_KEY = "specdec-session"


@dataclass(frozen=True)
class Hello:
    """Opens a session. ``draft`` is how its rounds are drafted unless a round says otherwise; the
    rest is fixed for the session."""
    vocab_fingerprint: str
    vocab_size: int
    temperature: float
    draft: DraftSettings
    seed: int = 0
    max_new_tokens: int = 256
    target_top_p: float = 0.0     # 0 = off; applied to the target distribution
    target_top_k: int = 0         # 0 = off; applied to the target distribution
    resume_session_id: str = ""   # resume this session instead of starting one
    resume_token: bytes = b""     # the secret the edge gave for it in Welcome
    protocol_version: int = PROTOCOL_VERSION
    target_fingerprint: str = ""  # the target the session ran on (Welcome's); "" = any target
    wants_end: bool = False       # the device reads End messages (and half-closes on one)
    target_min_p: float = 0.0     # 0 = off; applied to the target distribution
    adjust: LogitAdjust = NO_ADJUST  # logit bias and penalties, applied to the target distribution
    grammar: Grammar | None = None   # what the output must match (structured outputs); None: anything
    logprobs: int = NO_LOGPROBS      # each verdict's tokens' log-probabilities (0) and their top N (N > 0)
    continues_late: bool = False     # the device takes a late round's verdict (Draft.start in the proto)
    continues_late_edge_only: bool = False  # ... and a late edge-only round's rest, after tokens generated ahead
    stop_ids: tuple[int, ...] = ()   # the device's end-of-sequence ids (); () = the edge does not know them
    ignore_eos: bool = False         # the session goes on past end-of-sequence tokens to max_new_tokens

    @property
    def adjusts_law(self) -> bool:
        """Whether the law asks what only an edge that says ``Welcome.adjusts_law`` applies."""
        return bool(self.target_min_p) or self.adjust.active or self.grammar is not None


# An edge's limits unless its operator sets others (edge.verifier.EdgeLimits and edge-server's flags
# default to these), and what a Welcome that does not state one means (an edge from before it did).
DEFAULT_MAX_DRAFT_LEN = 32        # draft tokens per round
DEFAULT_MAX_K = 8192              # transmitted support size per distribution
MAX_STOP_IDS = 64                 # Hello.stop_ids: tokenizers name a handful; the bound keeps a Hello small
DEFAULT_DSSD_MAX_SAMPLES = 64     # downlink samples per DSSD rejection


@dataclass(frozen=True)
class Welcome:
    session_id: str
    model_name: str
    vocab_size: int
    max_context: int
    max_draft_len: int
    max_k: int
    protocol_version: int = PROTOCOL_VERSION
    resume_token: bytes = b""     # needed, with the same credentials, to resume this session
    resumed: bool = False         # the edge still had the session (its KV cache is reused)
    dssd_max_samples: int = 0     # the most dssd_samples a round may ask for (0: an edge that does not say)
    target_fingerprint: str = ""  # the target's weights and vocabulary ("": an edge that does not say)
    edge_name: str = ""           # which edge of a fleet serves the session
    # the edge's calibrated seconds of one target forward by its new tokens (empty: not calibrated)
    forward_cost: tuple[tuple[int, float], ...] = ()
    modes: tuple[Mode, ...] = ()  # the draft modes it verifies; () = an edge before the field (all but gumbel)
    draft_len_hint: int | None = None  # the load-aware advice for the first round (None: no advice)
    adjusts_law: bool = False     # applies Hello.target_min_p, .adjust and .grammar (False: an older edge)
    continues_late: bool = False  # continues a late round where the Hello asks (False: an older edge)
    continues_late_edge_only: bool = False  # ... and a late edge-only round (False: an older edge)
    ignores_eos: bool = False     # honours Hello.ignore_eos (False: an older edge)
    token_probs: bool = False     # honours DraftBlock.token_probs (False: an older edge)

    def verifies(self, mode: Mode) -> bool:
        """Whether this edge takes rounds of ``mode`` (an edge that does not say: every mode but gumbel)."""
        return mode in self.modes if self.modes else mode is not Mode.GUMBEL


@dataclass(frozen=True)
class DraftBlock:
    round_id: int
    token_ids: tuple[int, ...]                 # [L] drafted tokens x_1..x_L
    distributions: tuple[bytes, ...] = ()      # [L] codec payloads (not in DSSD)
    dssd_scalars: bytes = b""                  # DSSD: q_i(x_i), float64 each (bit for bit what was sampled)
    correction_token: int | None = None        # DSSD: device-sampled token for the last rejection
    tree_depth: int = 0                        # tree: layers drafted this round (config prefix)
    settings: DraftSettings | None = None      # how this round was drafted; None = the session's (Hello)
    id_bits: int = 0                           # > 0: token_ids travel packed at this width (gumbel rounds)
    sent_ahead: bool = False                   # edge-only: sent before the last round's end (void after an EOS)
    run_ahead_ms: int = 0                      # > 0: the edge runs ahead if the next message is this late
    start: int = 0                             # sequence index of the round's first token; 0 = not stated
    token_probs: bool = False                  # edge-only: each streamed token's log-probability, whatever the Hello asked


@dataclass(frozen=True)
class Verdict:
    round_id: int
    num_accepted: int
    next_token: int | None                     # correction / bonus; None in DSSD after a rejection
    reject_samples: tuple[int, ...] = ()       # DSSD: y_k ~ p_j
    reject_sample_probs: tuple[float, ...] = ()  # DSSD: p_j(y_k)
    verify_seconds: float = 0.0                # edge: decode + target forward + verification
    queue_seconds: float = 0.0                 # edge: waiting for a worker thread
    decode_seconds: float = 0.0                # edge: decoding the draft payloads
    accepted_nodes: tuple[int, ...] = ()       # tree: accepted path (node indices, depth order)
    more: bool = False                         # mode none: more tokens of this round follow
    draft_len_hint: int | None = None          # edge: longest draft that pays at its load (None: no advice)
    logprobs: tuple[TokenLogprob, ...] = ()    # one per emitted token, if the Hello asked (common/logprobs.py)
    ahead: bool = False                        # a token the edge generated ahead after this round
    superseded: bool = False                   # the round started before tokens generated ahead: no token


@dataclass(frozen=True)
class ResidualReply:
    """DSSD fallback: the whole p_j (``target_probs``), or its head (verification.DssdHead's fields)."""
    round_id: int
    target_probs: bytes = b""                  # whole: p_j over V, float64 little-endian
    head_ids: tuple[int, ...] = ()             # head: p_j's K largest entries ...
    head_probs: tuple[float, ...] = ()         # ... their p_j, float64
    tail_mass: float = 0.0                     # ... the mass of the rest
    tail_samples: tuple[int, ...] = ()         # ... y ~ p_j restricted to the rest
    tail_sample_probs: tuple[float, ...] = ()  # ... p_j(y)

    @property
    def is_head(self) -> bool:
        return bool(self.head_ids)


@dataclass(frozen=True)
class ResidualRequest:
    round_id: int
    whole: bool = False                        # the whole p_j, whatever the round's dssd_fallback_top_k


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    prompt_len: int = 0  # of token_ids, the prompt (a resumed session's prefix has output after it); 0 = all


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class End:
    """How the edge ends the session, sent before the status itself (see the proto's End)."""
    code: int                                  # the gRPC status code's number
    details: str
    reason: str = ""                           # as REASON_KEY
