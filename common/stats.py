"""Speculation statistics: one pure record per round and one accumulator, read by every consumer.

In the style of vLLM's ``SpecDecodingStats.observe_draft``: the device's JSON result, the daemon's
``specdec`` object, the device's Prometheus metrics and the edge's all read :class:`RoundRecord`s, so
acceptance, accepted length and bytes per token are defined here once. Pure: no clock, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from specdec.common.protocol import DraftBlock, Verdict

# One round's time, in order; they add up to the round on the device (commit aside): draft and
# encode on the device, the network round trip net of edge time, then the edge's worker-queue wait,
# payload decode and verification (target forward + accept/reject).
PHASES = ("draft", "encode", "network", "queue", "decode", "verify")
EDGE_PHASES = ("queue", "decode", "verify")


@dataclass(frozen=True)
class RoundRecord:
    mode: str
    drafted_tokens: int             # tokens (tree: nodes) sent
    positions: int                  # chain length, or tree depth: the acceptance rate's denominator
    accepted: int                   # draft tokens accepted
    generated: int                  # tokens the round added: accepted + the correction / bonus
    uplink_bytes: int = 0           # serialized, this round's Draft (+ a DSSD ResidualRequest)
    downlink_bytes: int = 0         # serialized, its Verdict (+ ResidualReply)
    theoretical_bits: int = 0       # the papers' uplink bit count for the round
    support_sizes: tuple[int, ...] = ()  # K of each packet sent
    phases: Mapping[str, float] = field(default_factory=dict)  # seconds per PHASES entry
    drafted_ahead: bool = False     # drafting began while the edge verified the previous round
    ahead_tokens: int = 0           # of its tokens, those sampled ahead
    ahead_discarded: int = 0        # tokens drafted ahead for the next round on a wrong guess
    threshold: float | None = None  # C-SQS threshold beta after the round
    draft_forwards: int = 0         # drafter forwards its "draft" phase took (0: not counted, trees)
    forward_s: tuple[float, ...] = ()  # seconds of each of those forwards that fed one token (chains;
                                    # mode auto's samples of the drafter's cost)
    residual_trips: int = 0         # DSSD fallback round trips (1: p_j's head or whole; 2: head, then whole)
    residual_bytes: int = 0         # of downlink_bytes: the fallback's ResidualReplies
    first_reply_s: float = 0.0      # network seconds until the first reply (edge-only rounds: the first
                                    # streamed token; a round trip, where the whole round's network
                                    # time also holds every further token's per-message costs)
    token_interval_s: float = 0.0   # edge-only rounds: mean seconds between its streamed tokens' arrivals
                                    # (how edge-only streams, everything in but the link's stalls;
                                    # 0: fewer than two arrived)
    stream_stall_s: float = 0.0     # edge-only rounds: seconds the link held the stream up (an outage)
    shadow: tuple[float, ...] = ()  # edge-only rounds (mode auto's shadow acceptance), per token it read: at
                                    # T = 0, 1 where the drafter's greedy choice was the streamed token;
                                    # at T > 0, min(1, q/p) of it (edge_only.shadow_acceptance)
    shadow_s: float = 0.0           # ... seconds of the drafter's forwards that measured it
    shadow_fed: int = 0             # ... tokens those forwards read

    def to_json(self) -> dict:
        """The round's numbers for a JSON round log (settings are the caller's to add)."""
        return {"drafted": self.drafted_tokens, "positions": self.positions, "accepted": self.accepted,
                "generated": self.generated, "uplink_bytes": self.uplink_bytes,
                "downlink_bytes": self.downlink_bytes, "phases": dict(self.phases),
                "drafted_ahead": self.drafted_ahead, "draft_forwards": self.draft_forwards,
                "residual_trips": self.residual_trips, "residual_bytes": self.residual_bytes,
                "first_reply_s": self.first_reply_s, "token_interval_s": self.token_interval_s,
                "stream_stall_s": self.stream_stall_s, "shadow_s": self.shadow_s, "shadow_fed": self.shadow_fed}

    @property
    def tested(self) -> int:
        """Positions the edge tested: the accepted ones and the one that was rejected, if any."""
        return self.accepted + (self.accepted < self.positions)


@dataclass
class SpecStats:
    """Totals over the rounds of one session (or of many): the one account every consumer reads (the
    device's JSON and GenerationResult, the daemon's ``specdec`` object, benchmarks)."""
    rounds: int = 0
    draft_tokens: int = 0           # tokens (tree: nodes) sent
    draft_positions: int = 0        # chain: = draft_tokens; tree: sum of depths
    accepted_tokens: int = 0
    positions_verified: int = 0     # positions the edge tested: accepted + one per round that rejected
    generated_tokens: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    theoretical_uplink_bits: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)  # rounds that drafted position i
    ahead_rounds_used: int = 0      # rounds whose drafting began while the edge verified the last one
    ahead_tokens_used: int = 0      # draft tokens sampled ahead and sent
    ahead_tokens_discarded: int = 0  # sampled ahead on a wrong guess (never sent)
    dssd_fallbacks: int = 0         # DSSD rejections whose m samples all failed ...
    dssd_residual_trips: int = 0    # ... and the round trips they took (one more per head that ran out)
    round_uplink_bytes: list[int] = field(default_factory=list)  # per round, in order

    def observe(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.draft_tokens += r.drafted_tokens
        self.draft_positions += r.positions
        self.accepted_tokens += r.accepted
        self.positions_verified += r.tested
        self.generated_tokens += r.generated
        self.uplink_bytes += r.uplink_bytes
        self.downlink_bytes += r.downlink_bytes
        self.theoretical_uplink_bits += r.theoretical_bits
        for phase, s in r.phases.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + s
        grow = r.positions - len(self.drafted_per_position)
        self.drafted_per_position += [0] * max(0, grow)
        self.accepted_per_position += [0] * max(0, grow)
        for i in range(r.positions):
            self.drafted_per_position[i] += 1
        for i in range(r.accepted):
            self.accepted_per_position[i] += 1
        self.ahead_rounds_used += r.drafted_ahead
        self.ahead_tokens_used += r.ahead_tokens
        self.ahead_tokens_discarded += r.ahead_discarded
        self.dssd_fallbacks += r.residual_trips > 0
        self.dssd_residual_trips += r.residual_trips
        self.round_uplink_bytes.append(r.uplink_bytes)

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted tokens / drafted positions (trees: one position per layer)."""
        return _ratio(self.accepted_tokens, self.draft_positions)

    @property
    def token_acceptance_rate(self) -> float:
        """The papers' i.i.d. alpha (TSLT eq. 8): accepted / positions the edge tested."""
        return _ratio(self.accepted_tokens, self.positions_verified)

    @property
    def mean_accepted_length(self) -> float:
        return _ratio(self.accepted_tokens, self.rounds)

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [_ratio(a, d) for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def summary(self) -> dict:
        """The daemon's per-choice ``specdec`` object (the one-shot JSON has these and more)."""
        return {"rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def edge_phases(verdict: Verdict) -> dict[str, float]:
    """The edge's phases of a round from its Verdict: the edge's verify_seconds includes payload
    decode, so it is split off and the phases add up."""
    return {"queue": verdict.queue_seconds, "decode": verdict.decode_seconds,
            "verify": max(0.0, verdict.verify_seconds - verdict.decode_seconds)}


def edge_record(draft: DraftBlock, verdict: Verdict, mode: str, uplink: int, downlink: int) -> RoundRecord:
    """What the edge knows of a round: the draft it received and the verdict it sent."""
    generated = verdict.num_accepted + (verdict.next_token is not None)  # DSSD rejection: the device adds it
    phases = edge_phases(verdict)
    return RoundRecord(mode=mode, drafted_tokens=len(draft.token_ids),
                       positions=draft.tree_depth or len(draft.token_ids),  # tree_depth is 0 for chains
                       accepted=verdict.num_accepted, generated=generated, uplink_bytes=uplink,
                       downlink_bytes=downlink, phases=phases)


def edge_only_record(generated: int, uplink: int, downlink: int, verify: float, queue: float) -> RoundRecord:
    """An edge-only round (mode none): no draft, ``generated`` tokens from the target alone."""
    return RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=generated,
                       uplink_bytes=uplink, downlink_bytes=downlink,
                       phases={"queue": queue, "decode": 0.0, "verify": verify})
