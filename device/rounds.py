"""What a device round is, from its plan to its committed event: the data every round kind shares.

A round's life: a :class:`RoundPlan` fixes its settings before any random number of its positions is
drawn (chosen from committed rounds only, or repeated for a retry); drafting makes a
:class:`RoundDraft` (the message sent and what the device keeps to finish the round); when its
verdict is applied, the session produces one :class:`RoundEvent`, which is all that the session's
account, the metrics, mode auto and the round log ever learn about the round.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from specdec.common.protocol import DraftBlock, DraftSettings, Verdict
from specdec.common.modes import Mode
from specdec.common.stats import RoundRecord, edge_phases
from specdec.common.tree import TreeSpec


@dataclass(frozen=True)
class RoundPlan:
    """How one round runs. Fixed before any random number of its positions is drawn or looked at,
    and repeated exactly when the round is retried."""
    settings: DraftSettings
    choice: Mapping[str, Any] | None = None  # mode auto: the choice and its estimates (round log, metrics)
    decision: Any = None                      # the policy's own record of the choice, handed back in the event
    retry: bool = False                       # a round repeated after a broken stream
    # Mode auto: tokens an edge-only round asks for where the edge advises no drafting, from its
    # boundary model (a round trip and the forward a busy batch makes without the session); 0: none.
    edge_chunk: int = 0
    # Mode auto: an edge-only round that would leave fewer tokens than this for the session asks for
    # them too: a round of so few would wait a round trip for its first token for nothing.
    edge_tail: int = 0


@dataclass
class RoundDraft:
    """One round's draft and what the device keeps to finish it."""
    block: DraftBlock
    plan: RoundPlan
    q_rows: list[torch.Tensor]      # [V] float64 per position (tree: per internal node): sampled-from q
    theoretical_bits: int
    support_sizes: list[int]
    draft_seconds: float            # drafter forwards + sampling
    encode_seconds: float           # codec encode + decode
    start: int = 0                  # sequence position of the round's first draft token (its streams' key)
    tree: TreeSpec | None = None    # the round's tree (a prefix of the configured one)
    dropped: list[float] = field(default_factory=list)  # C-SQS: dropped mass per encoded q
    drafted_ahead: bool = False     # its drafting began while the edge verified the last round ...
    ahead_steps: int = 0            # ... and this many of its tokens were drafted by the time it became the next
    draft_forwards: int = 0         # drafter forwards in draft_seconds (chains; 0 for trees)
    forward_s: tuple[float, ...] = ()  # seconds of each of them that fed one token (chains)
    q_stats: list[Any] = field(default_factory=list)  # the policy's measurements of its encoded q's
    received: int = 0               # edge-only rounds: tokens streamed so far
    sent_ahead: bool = False        # edge-only: its request went out while the round before it streamed
    block_bytes: int = 0            # edge-only: the serialized size of its request, once sent
    continued_after: int = 0        # edge-only: tokens the edge generated ahead past its start, then continued it
    # edge-only (the shadow): per token fed, the drafter's greedy agreement (T = 0) or min(1, q/p) (T > 0)
    shadow: list[float] = field(default_factory=list)
    shadow_s: float = 0.0           # ... seconds of the forwards that measured it
    shadow_fed: int = 0             # ... tokens they read (the prompt's too, in a session's first)

    @property
    def settings(self) -> DraftSettings:
        return self.plan.settings

    @property
    def positions(self) -> int:
        """Draft positions (tree depth for trees): the denominator of the acceptance rate."""
        return self.tree.depth if self.tree is not None else len(self.block.token_ids)


@dataclass(frozen=True)
class RoundIO:
    """What the round cost on the link, as the round loop measured it."""
    uplink_bytes: int = 0           # serialized Draft (+ ResidualRequests)
    downlink_bytes: int = 0         # serialized Verdicts (+ ResidualReplies)
    network_s: float = 0.0          # wall time of the round trips minus the edge's reported time
    residual_trips: int = 0         # DSSD fallback round trips
    residual_bytes: int = 0         # of downlink_bytes: the fallback's replies
    first_reply_s: float | None = None  # network seconds until the first reply (None: network_s)
    token_interval_s: float = 0.0   # edge-only: mean seconds between streamed tokens' arrivals (0: < 2)
    stream_stall_s: float = 0.0     # edge-only: seconds the link held its stream up (edge_only.stream_stall)


@dataclass(frozen=True)
class RoundEvent:
    """One committed round: produced once, when its verdict is applied."""
    record: RoundRecord
    plan: RoundPlan
    new_tokens: tuple[int, ...]     # what the round added to the verified sequence
    q_stats: tuple[Any, ...]        # the policy's measurements of the round's encoded q's
    guess: bool | None              # the next round was drafted ahead: was its bonus guess right? (None: not drafted ahead, or not all accepted)
    elapsed_s: float                # from the round becoming the next one to its verdict applied
    edge_hint: int | None           # the edge's draft-length advice in the round's verdict
    t: float                        # seconds since the session started
    ahead_steps: int = 0            # tokens drafted before it became the next round (drafted ahead)
    sent_ahead: bool = False        # edge-only: its request went out while the round before it streamed
                                    # (so its first token's wait is no round-trip sample)
    ran_ahead: bool = False         # tokens the edge generated ahead while a round was overdue (run_ahead.py)
    declined_ahead: bool = False    # drafted after a round accepted whole whose plan made ahead for it was
                                    # edge-only: nothing was drafted ahead (DraftSession.plan_ahead)
    planned_ahead: dict | None = None  # the plan made for the next round while this one was verified (logged)

    @property
    def settings(self) -> DraftSettings:
        return self.plan.settings


@dataclass
class AheadPlans:
    """The plans made ahead of verdicts (DraftSession.plan_ahead): the round log shows each, and mode
    auto's net needs to know which drafted round waited for drafts because one was edge-only."""
    logged: dict | None = None          # the plan made for the next round while the one in flight is verified
    declined: RoundDraft | None = None  # the round in flight, if that plan drafted nothing ahead
    after_declined: bool = False        # ... and it was accepted whole: the next round waits for its drafts

    def made(self, rd: RoundDraft, plan: RoundPlan, ahead: bool) -> RoundPlan | None:
        """``plan`` was made for the round after ``rd`` while ``rd`` is verified: itself if the round is
        to be drafted ``ahead``, else None."""
        s = plan.settings
        self.logged = {"mode": s.mode.value, "draft_len": s.draft_len, "why": (plan.choice or {}).get("why")}
        self.declined = None if ahead else rd
        return plan if ahead else None

    def commit(self, rd: RoundDraft, record: RoundRecord) -> dict:
        """``rd`` committed: its RoundEvent's ``declined_ahead`` (a drafted round that waited for drafts
        the plan made ahead of the verdict before it declined) and ``planned_ahead``."""
        whole = record.positions > 0 and record.accepted == record.positions
        out = {"declined_ahead": self.after_declined and rd.settings.mode is not Mode.NONE,
               "planned_ahead": self.logged}
        self.after_declined, self.declined, self.logged = whole and self.declined is rd, None, None
        return out


def round_record(rd: RoundDraft, verdict: Verdict, generated: int, io: RoundIO, threshold: float | None,
                 ahead_discarded: int = 0) -> RoundRecord:
    """The round's :class:`RoundRecord` once its verdict (and any DSSD fallback) is in."""
    phases = {"draft": rd.draft_seconds, "encode": rd.encode_seconds, "network": io.network_s,
              **edge_phases(verdict)}
    drafted = len(rd.block.token_ids)
    return RoundRecord(
        mode=rd.settings.mode.value, drafted_tokens=drafted, positions=rd.positions, accepted=verdict.num_accepted,
        generated=generated, uplink_bytes=io.uplink_bytes, downlink_bytes=io.downlink_bytes,
        theoretical_bits=rd.theoretical_bits, support_sizes=tuple(rd.support_sizes), phases=phases,
        drafted_ahead=rd.drafted_ahead, ahead_tokens=drafted if rd.drafted_ahead else 0,
        ahead_discarded=ahead_discarded, threshold=threshold, draft_forwards=rd.draft_forwards,
        forward_s=rd.forward_s, shadow=tuple(rd.shadow), shadow_s=rd.shadow_s, shadow_fed=rd.shadow_fed,
        residual_trips=io.residual_trips, residual_bytes=io.residual_bytes,
        first_reply_s=io.network_s if io.first_reply_s is None else io.first_reply_s,
        token_interval_s=io.token_interval_s, stream_stall_s=io.stream_stall_s)


def round_settings_json(s: DraftSettings) -> dict:
    """What a round log says about how a round was drafted."""
    out = {"mode": s.mode.value}
    if s.mode is Mode.NONE:
        return {**out, "edge_tokens": s.edge_tokens}
    out["draft_len"] = len(s.tree) if s.tree else s.draft_len
    if s.mode in (Mode.TSLT, Mode.KSQS):
        out["top_k"] = s.top_k
    if s.tree:
        out["tree"] = list(s.tree)
    return out
