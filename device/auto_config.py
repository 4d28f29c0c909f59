"""Mode auto's settings in one object, :class:`AutoConfig`: the candidates it chooses among, how
eagerly it switches, and the constants of what it learns (the link's fit, :class:`~specdec.device.link_fit.LinkConfig`;
the model-side estimates, :class:`EstimateConfig`; the safety net, :class:`~specdec.device.safety_net.NetConfig`),
each with a line on why. The measurements that chose them: docs/modes.md, "Why mode auto's constants
are what they are"."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.common.protocol import DEFAULT_DSSD_MAX_SAMPLES, DEFAULT_MAX_DRAFT_LEN, DEFAULT_MAX_K
from specdec.device import autotune as A
from specdec.device import safety_net as N
from specdec.device.link_fit import LinkConfig


@dataclass(frozen=True)
class EstimateConfig:
    """How the estimates that depend on the two models and the text learn: acceptance, the bonus
    guess, DSSD's fallback share, codec sizes and times. Shares, weights and counts of rounds: none is
    tied to a machine."""
    decay: float = 0.9               # weight kept by older samples per new one (EWMA)
    # per round (not per tested position, which a text rejected at depth 1 every round hardly moves):
    # a session's estimate follows its text in ~10
    accept_decay: float = 0.9
    # per round: the device's long-run acceptance, where each session starts (not the last session's:
    # one bad text's tail must not set the next sessions)
    long_accept_decay: float = 0.995
    prior_alpha: float = 0.8         # acceptance before any round ...
    prior_weight: float = 8.0        # ... worth this many positions (a temperature never run: the
                                     # nearest measured one's rate instead, auto.lent_alpha)
    # a tested position of the other kind (gumbel / exact q), mapped, counts half: each kind's own
    # rounds say most about it
    cross_weight: float = 0.5
    # the most a remembered long-run acceptance weighs: a few sessions' rounds move it (the drafter or
    # its texts may have changed since)
    remembered_positions: float = 32.0
    max_depth: int = 32              # depths with their own acceptance estimate (deeper ones share the last)
    depth_prior_weight: float = 4.0  # rounds' worth behind each depth's shrinkage toward alpha_base
    depth_decay: float = 0.95        # per round reaching a depth (~20 rounds: one sample a round)
    prior_guess: float = 0.7         # P(bonus guessed | all accepted) before any evidence
    prior_fallback_weight: float = 2.0  # rejections' worth of the alpha^m prior on DSSD's fallback share


@dataclass(frozen=True)
class AutoConfig:
    """The candidates ``mode auto`` chooses among, and how eagerly it switches. Why these values:
    docs/modes.md, "Why mode auto's constants are what they are"."""
    # TSLT supports. Not 1024: at T = 1 its packet is 4x K = 256's for little more acceptance.
    top_ks: tuple[int, ...] = (16, 64, 256)
    ksqs_ks: tuple[int, ...] = (64,)                   # K-SQS supports (lattice below)
    lattice: int = 1000
    draft_lens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
    dense: bool = True
    # DSSD: its rounds draft ahead like the other chains (coupled bonus) and send the exact q's
    # acceptance in a few bytes. The model charges it for its fallback: a trip and p_j's head
    # (measured; before that verification.dssd_fallback_bytes).
    dssd: bool = True
    # m of auto's DSSD rounds: a rejection needs a fallback trip when all m samples y ~ p_j fail, each
    # with probability 1 - TV(p_j, q_j), most of the time for a close drafter at small m; 12 bytes a
    # sample, and the edge's default cap.
    dssd_samples: int = DEFAULT_DSSD_MAX_SAMPLES
    # Gumbel rounds send token ids only (2 bytes a position at V = 49152), accepted a little less often
    # than the exact q's rejection sampling (make bench-coupling). Only against edges that verify them
    # (Welcome.modes).
    gumbel: bool = True
    edge_only: bool = True
    hysteresis: float = 0.05   # keep the current choice unless another is predicted this much faster
    # The safety net (device/safety_net.py): which of edge-only and drafted rounds runs, from what each
    # delivered (the model's pick within the drafted arm), and how the worse arm is explored.
    net: N.NetConfig = N.NetConfig()
    # The first round of a session on a link the device knows nothing of (no round seen, nothing
    # remembered) is edge-only: it cannot lose to edge-only, and while it streams the drafter reads
    # the prompt.
    cold_start: bool = True
    link: LinkConfig = LinkConfig()  # the link's fit (device/link_fit.py)
    estimates: EstimateConfig = EstimateConfig()  # how the model-side estimates learn (below)
    # A goodput probe (LinkFit.probe_due) runs if a fast link would make rounds this much faster
    # (where every codec sends a few bytes, as at T = 0, no goodput changes the choice).
    probe_min_gain: float = 0.1
    # An edge-only round's boundary (round trip + a forward) may cost this share of it, within
    # these chunks: a round of 8 tokens still answers the net's next exploration soon.
    edge_chunk_overhead: float = 0.05
    edge_chunk_min: int = 8
    edge_chunk_max: int = 64
    # Where drafting's best case cannot beat edge-only (safety_net.spec_pays), an edge-only round asks
    # for this many seconds of tokens (the session's rest if fewer): each boundary is a request on the
    # uplink, and one sent ahead leaves only as the round's tokens arrive, so an outage at a boundary
    # leaves the edge idle where edge-only's single stream went on generating through it. Seconds of
    # the user's wait before a drafter that became fast enough is drafted with again (its forwards are
    # timed while rounds stream and the choice is made at each boundary): the same on any device.
    edge_round_unpaid_s: float = 10.0
    # Weight of what was learned before each new observation, relative to the decays above: 1 keeps
    # them; 0 makes every estimate its latest observation (tests: a controller as sensitive to each
    # round as it can be, so that a choice that could see a round's own draws would show it).
    memory: float = 1.0

    def candidates(self, vocab_size: int, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
                   max_k: int = DEFAULT_MAX_K) -> list[A.Candidate]:
        cap = min(vocab_size, max_k)
        ks = tuple(sorted({min(k, cap) for k in self.top_ks}))
        lens = tuple(L for L in self.draft_lens if L <= max_draft_len)
        return A.candidate_grid(ks, lens, tuple(sorted({min(k, cap) for k in self.ksqs_ks})), self.dense,
                                self.dssd, self.edge_only, self.gumbel)
