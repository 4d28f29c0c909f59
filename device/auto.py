"""``mode auto``: before each round, pick mode, K and draft length from what the device measures.

:class:`LinkTracker` is the device's memory of its link and models (shared by its sessions, since
they share the link); :class:`AutoPolicy` is one session's controller, called by
:meth:`DraftSession.choose` before each round is drafted (ahead or not) and fed each committed
round's :class:`~specdec.device.rounds.RoundEvent`. The choice itself is :func:`specdec.device.autotune.best`,
pure math over the :class:`~specdec.device.autotune.Estimates` built here.

What is measured, per round (all from what the device already sees):
  * round trip, uplink and downlink goodput, stalls and changes of the link (:mod:`.link_fit`);
  * the edge's time per forward, an affine fit in the tokens of the forward (each Verdict reports it;
    :mod:`.verify_fit`);
  * drafter time per forward (a round of L drafts takes L or L + 1) and codec time per drafted token;
  * acceptance: every tested position adds (accepted + TV(q_hat, q) of its packet) to alpha_base, the
    acceptance the exact q would have (TSLT eq. 22), overall and per depth in the round (acceptance
    is correlated along a round), per session (:class:`SessionAcceptance`: sessions at once draft
    different texts) and over the device's sessions (where a new one starts), and every encoded q
    adds its dropped mass for each candidate K, so a K never sent still gets an estimate;
  * gumbel rounds' acceptance (a draft kept iff it is the target's own draw): their own rate per
    tested position and per depth (:class:`GumbelAcceptance`), shrunk toward a prior from alpha_base
    (:func:`~specdec.device.autotune.gumbel_prior`) until they have run; gumbel rounds do not feed
    alpha_base (theirs is another event);
  * the share of drafted-ahead rounds kept (bonus guessed), DSSD's fallback share.
Model-side estimates are kept per temperature (acceptance depends on it), link-side ones once.

Lossless whatever it picks: each round is drafted, sent and verified with the settings it names.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import torch

from specdec.device import autotune as A
from specdec.common.logprobs import NO_LOGPROBS
from specdec.common.modes import Mode, RACE_MODES
from specdec.common.protocol import (DEFAULT_DSSD_MAX_SAMPLES, DEFAULT_MAX_DRAFT_LEN, DEFAULT_MAX_K, DraftSettings,
                                     Hello, Welcome)
from specdec.common.stats import RoundRecord
from specdec.device import safety_net as N
from specdec.device import tracker_state as TS
from specdec.device.auto_config import AutoConfig, EstimateConfig
from specdec.device.link_fit import LinkFit
from specdec.device.tracker_state import FAST_LINK_BPS, TIME_SCALE_MAX, TIME_SCALE_MIN
from specdec.device import q_measure as Q
from specdec.device.q_measure import QStats
from specdec.device.rounds import RoundEvent, RoundPlan
from specdec.device.run_ahead import OverdueClock
from specdec.device.verify_fit import VerifyFit
from specdec.common.verification import dssd_fallback_bytes

# A level shift: this many samples in a row beyond this share of the estimate (the same way) replace it
# (_Stepped). Three: one or two slow forwards (a page fault, a GC pause) are noise.
STEP_SAMPLES = 3
STEP_SHIFT = 0.25
# A drafter whose cost per forward jumped by this factor (either way) is another device: the drafted
# rounds the safety net measured before describe a drafter that no longer runs (N.drafter_changed).
# Drafting is about half a drafted round's time wherever drafting pays at all (a drafter costing more
# than the target's forward per token never pays), so 1.4x moves that round by ~20 %: more than the
# net's margin, and a step no scatter of forwards makes three times in a row.
DRAFTER_CHANGE = 1.4
# Forwards of the drafter timed in an edge-only round (in place of an exploration, NetCall.retime, or
# before one): as many as a step of its cost takes (_Stepped), so that one timing finds a changed drafter.
RETIME_FORWARDS = STEP_SAMPLES
# Rounds that measure rather than choose (the net exploring the other arm, a link probe): their candidate
# does not become the model's incumbent. Kept by hysteresis, an exploration of a candidate the model
# predicts a little slower than edge-only makes drafting the model's arm, and the net then needs drafted
# rounds to prove it slower, instead of the exploration's own rounds to prove it faster.
MEASURING = ("explore", "probe")


class _Ewma:
    def __init__(self, prior: float | None, decay: float):
        self.value, self.decay = prior, decay

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


class _Stepped(_Ewma):
    """An EWMA that jumps to a level its samples moved to: ``STEP_SAMPLES`` in a row beyond
    ``STEP_SHIFT`` of it, the same way, replace it by their mean. A device's speed shifts in steps (it
    throttles, another app takes its cores, a drafter-cost change in the bench), and the EWMA alone
    took ~14 drafted rounds to follow a drafter 2.7x slower, drafting at 0.8x edge-only's speed all
    the while; a forward's time otherwise scatters well within the shift."""

    def __init__(self, prior: float | None, decay: float):
        super().__init__(prior, decay)
        self.run: list[float] = []
        self.run_from = prior

    def add(self, x: float) -> float | None:
        """Add a sample; the new level over the old one if it jumped (None if it did not)."""
        v = self.value
        beyond = v is not None and v > 0 and (x > v * (1 + STEP_SHIFT) or x * (1 + STEP_SHIFT) < v)
        same_way = beyond and all((y > v) == (x > v) for y in self.run)
        if not same_way or not self.run:
            self.run_from = v  # the level the run left (each of its samples moves the EWMA meanwhile)
        self.run = [*self.run, x] if same_way else ([x] if beyond else [])
        if len(self.run) >= STEP_SAMPLES:
            self.value, self.run = sum(self.run) / len(self.run), []
            return self.value / self.run_from
        super().add(x)
        return None


class _Ratio:
    """A decayed ratio: each :meth:`add` keeps ``decay`` of the hits and trials before it."""

    def __init__(self, hits: float, trials: float, decay: float):
        self.hits, self.trials, self.decay = hits, trials, decay

    def add(self, hits: float, trials: float = 1.0) -> None:
        self.hits = self.decay * self.hits + hits
        self.trials = self.decay * self.trials + trials

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    def shrunk(self, prior: float, weight: float) -> float:
        """The ratio with ``weight`` trials' worth of ``prior`` added."""
        return (self.hits + weight * prior) / (self.trials + weight)


class _Acceptance:
    """Acceptance per tested position, overall and per depth in the round, decayed per round so that it
    follows a session's text."""

    def __init__(self, accept: _Ratio, memory: float, cfg: EstimateConfig):
        self.accept, self.cfg = accept, cfg
        # the same per depth d + 1, over the rounds that reached it: acceptance is correlated along a
        # round (a draft accepted at depth 1 makes the next likelier), which eq. (8)'s one rate misses,
        # and with it how often a long round is accepted whole
        self.depth = [_Ratio(0.0, 0.0, cfg.depth_decay * memory) for _ in range(cfg.max_depth)]

    def add_positions(self, values: list[float], weight: float = 1.0) -> None:
        """One round's tested positions, each its (expected) acceptance, with ``weight`` trials each."""
        self.accept.add(weight * sum(values), weight * len(values))
        for d, v in enumerate(values[:self.cfg.max_depth]):  # one sample per depth the round reached
            self.depth[d].add(weight * v, weight)


class SessionAcceptance(_Acceptance):
    """One session's acceptance with the exact q: (accepted + TV) per tested position, overall and per
    depth. Each session has its own (sessions running at once draft different texts); it starts from
    the device's long-run rate (``start``)."""

    def __init__(self, start: float | None = None, memory: float = 1.0, cfg: EstimateConfig = EstimateConfig()):
        start = cfg.prior_alpha if start is None else start
        super().__init__(_Ratio(start * cfg.prior_weight, cfg.prior_weight, cfg.accept_decay * memory), memory, cfg)

    def add(self, accepted: int, tested: int, tv: float) -> None:
        self.add_positions([(d < accepted) + tv for d in range(tested)])

    @property
    def alpha_base(self) -> float:
        return min(1.0, self.accept.rate)

    def alpha_depth(self) -> tuple[float, ...]:
        """Acceptance per depth given the earlier drafts accepted: each depth's counts shrunk toward
        alpha_base, so a depth no round reached is predicted at the overall rate."""
        base = self.alpha_base
        return tuple(min(1.0, d.shrunk(base, self.cfg.depth_prior_weight)) for d in self.depth)


class GumbelAcceptance(_Acceptance):
    """One session's gumbel acceptance (a draft kept iff it is the target's own race, another event than
    the exact q's acceptance): kept drafts per tested position of its gumbel rounds, and the other
    rounds' through :func:`~specdec.device.autotune.race_from_exact` at ``cross_weight``; no prior of its
    own (:meth:`estimate` shrinks toward one)."""

    def __init__(self, memory: float = 1.0, cfg: EstimateConfig = EstimateConfig()):
        super().__init__(_Ratio(0.0, 0.0, cfg.accept_decay * memory), memory, cfg)

    def estimate(self, prior: float) -> tuple[float, tuple[float, ...]]:
        """(acceptance per position, per depth): the counts shrunk toward ``prior`` (``prior_weight``
        positions' worth), each depth's toward that (``depth_prior_weight`` rounds' worth)."""
        c = self.cfg
        base = min(1.0, max(0.0, self.accept.shrunk(prior, c.prior_weight)))
        return base, tuple(min(1.0, max(0.0, d.shrunk(base, c.depth_prior_weight))) for d in self.depth)


class _ModelSide:
    """Estimates that depend on the two models and the temperature, not on the link or the text."""

    def __init__(self, greedy: bool, memory: float, cfg: EstimateConfig):
        self.greedy, self.memory, self.cfg = greedy, memory, cfg
        # (accepted + TV) per tested position over many sessions: where each new session starts (before
        # any, LinkTracker.model lends it another temperature's)
        self.long = _Ratio(cfg.prior_alpha * cfg.prior_weight, cfg.prior_weight, cfg.long_accept_decay * memory)
        # the same over gumbel rounds (their own event), no prior of its own: gumbel_prior's of the above
        self.long_gumbel = _Ratio(0.0, 0.0, cfg.long_accept_decay * memory)
        self.sigma: dict[tuple[Mode, int], _Ewma] = {}  # TV(q_hat, q) per codec key
        # payload bytes per draft position per codec key: they depend on q (a greedy q is one token,
        # whatever K), so per temperature; from sample encodings and from the rounds actually sent
        self.packet_bytes: dict[tuple[Mode, int], _Ewma] = {}
        self.encoded = 0                                 # q encoded at this temperature
        # bonus guessed, of fully accepted rounds drafted ahead (two rounds' worth of prior)
        self.guess = _Ratio(cfg.prior_guess * 2, 2.0, cfg.decay * memory)
        self.fallback = _Ratio(0.0, 0.0, cfg.decay * memory)  # fallbacks, of DSSD rejections

    @property
    def tested(self) -> bool:
        """Whether any position was tested at this temperature (the long-run ratio holds more than its
        prior's weight)."""
        return self.long.trials > self.cfg.prior_weight

    def fallback_rate(self, samples: int, alpha: float) -> float:
        """P(a DSSD rejection needs the full p_j): measured, shrunk toward alpha^m. A sample y ~ p_j is
        kept with probability TV(p_j, q_j) ~ 1 - alpha, so all m fail with probability ~alpha^m:
        the better the drafter, the likelier a rejection costs a second round trip. At T = 0 a
        rejection means q_j missed p_j's one token, and that token is always kept."""
        prior = 0.0 if self.greedy else alpha ** samples  # T = 0: y = argmax p always survives
        return self.fallback.shrunk(prior, self.cfg.prior_fallback_weight)

    def gumbel_prior(self, alpha_base: float) -> float:
        """Where a session's gumbel estimate starts: the device's long-run gumbel rate, shrunk toward
        the prior from ``alpha_base`` (all prior until gumbel rounds have run)."""
        return self.long_gumbel.shrunk(A.gumbel_prior(alpha_base, self.greedy), self.cfg.prior_weight)

    def session(self) -> SessionAcceptance:
        """A new text's acceptance, starting from the device's long-run rate (``prior_weight`` positions'
        worth; its per-depth counts start from nothing and shrink toward that rate)."""
        return SessionAcceptance(min(1.0, self.long.rate), self.memory, self.cfg)

    def add_sigma(self, key: tuple[Mode, int], tv: float) -> None:
        self.sigma.setdefault(key, self._ewma()).add(tv)

    def add_bytes(self, key: tuple[Mode, int], size: float) -> None:
        self.packet_bytes.setdefault(key, self._ewma()).add(size)

    def _ewma(self) -> _Ewma:
        return _Ewma(None, self.cfg.decay * self.memory)

    def tv(self, key: tuple[Mode, int]) -> float:
        e = self.sigma.get(key)
        return e.value if e is not None and e.value is not None else 0.0


class LinkTracker:
    """What one device knows about its link, its drafter and the edge; shared by its sessions."""

    def __init__(self, config: AutoConfig = AutoConfig()):
        self.config = config
        self._codecs = Q.Codecs(config.top_ks, config.ksqs_ks, config.lattice, config.dense)  # measured (q_measure)
        self.lock = threading.Lock()   # encode hooks run in worker threads, rounds on the event loop
        self.link = LinkFit(config.link, config.memory)  # round trip, goodputs, stalls (device/link_fit.py)
        self.fallback_bytes = self._ewma()  # a DSSD fallback's replies (head, or head and whole p_j)
        self.verify = VerifyFit()  # the edge's forward time by its tokens (device/verify_fit.py)
        self.draft_s = self._ewma(kind=_Stepped)
        self.encode_s: dict[Mode, _Ewma] = {}   # device: codec encode + decode per draft token
        self.decode_s: dict[Mode, _Ewma] = {}   # edge: payload decode per draft token
        self.queue_s = self._ewma(0.0)          # edge: wait for its worker per round
        # edge-only's seconds per streamed token as its rounds measured it (everything in): the fit of
        # the edge's forwards extrapolates a one-token forward from drafted rounds' forwards, which can
        # price edge-only far from how it streams (docs/modes.md)
        self.edge_token_s = self._ewma()
        self.shadow_token_s = self._ewma()  # the shadow's forwards per token they read (edge_only.catch_up)
        self.models: dict[float, _ModelSide] = {}
        self.dssd_samples = config.dssd_samples  # m of the DSSD rounds this device sends
        self.time_scale: dict[tuple[Mode, int], _Ewma] = {}  # measured / modelled round time per codec key
        self.rounds_seen = 0      # committed rounds observed (by any session)
        self.drafter_changes = 0  # steps of the drafter's cost by DRAFTER_CHANGE: sessions drop what their
                                  # nets measured of drafting before one
        self.nets: dict[float, N.NetState] = {}  # per temperature: what each arm delivered, over the sessions
        self.restored = False     # started from a remembered state (device/edge_memory.py)
        self.overdue = OverdueClock()  # the round trips and turnarounds its sessions' clocks share

    @property
    def known(self) -> bool:
        """Whether the device has measured this link (a committed round, or a remembered one)."""
        return self.rounds_seen > 0 or self.restored

    def _ewma(self, prior: float | None = None, kind: type[_Ewma] = _Ewma) -> _Ewma:
        return kind(prior, self.config.estimates.decay * self.config.memory)

    # -- remembered across processes (device/edge_memory.py) ------------------------------------------------
    def snapshot(self) -> TS.TrackerState:
        """What this tracker knows (device/tracker_state.py): the link and the edge (with the safety
        net's measurements of both arms), and the drafter with this edge's target per temperature."""
        with self.lock:
            values = lambda d: {k: e.value for k, e in d.items() if e.value is not None}  # noqa: E731
            link = TS.LinkState(rtt_s=self.link.rtt_s(), uplink_bps=self.link.uplink_bps(),
                                measured_up_bits=max(self.link.sizes_sent, default=0.0),
                                downlink_bps=self.link.downlink_bps(),
                                verify=tuple(tuple(x) for x in self.verify.points), queue_s=self.queue_s.value,
                                edge_token_s=self.edge_token_s.value,
                                decode_s=values(self.decode_s), time_scale=values(self.time_scale),
                                nets={t: N.remembered(net) for t, net in self.nets.items()})
            temps = {t: TS.SideState(long=(side.long.hits, side.long.trials), guess=(side.guess.hits, side.guess.trials),
                                     fallback=(side.fallback.hits, side.fallback.trials),
                                     long_gumbel=(side.long_gumbel.hits, side.long_gumbel.trials),
                                     sigma=values(side.sigma), packet_bytes=values(side.packet_bytes),
                                     encoded=side.encoded) for t, side in self.models.items()}
            models = TS.ModelsState(draft_s=self.draft_s.value, fallback_bytes=self.fallback_bytes.value,
                                    encode_s=values(self.encode_s), temperatures=temps)
            return TS.TrackerState(link, models)

    def restore(self, state: TS.TrackerState) -> None:
        """Start from a remembered state (either part may be None: too old, or never saved). A
        remembered acceptance weighs at most ``remembered_positions`` positions, so that this device's new
        rounds move it."""
        with self.lock:
            if state.link is not None:
                self._restore_link(state.link)
            if state.models is not None:
                self._restore_models(state.models)
            self.restored = self.restored or state.link is not None

    def _restore_link(self, s: TS.LinkState) -> None:
        self.link.restore(s)
        self.verify.points.extend(s.verify)
        if s.queue_s is not None:
            self.queue_s.value = s.queue_s
        if s.edge_token_s is not None:
            self.edge_token_s.value = s.edge_token_s
        for m, v in s.decode_s.items():
            self.decode_s.setdefault(m, self._ewma()).value = v
        for k, v in s.time_scale.items():
            self.time_scale.setdefault(k, self._ewma()).value = v
        for t, net in s.nets.items():  # each session weighs them as a few rounds (safety_net.start_from)
            self.nets.setdefault(float(t), net)

    def _restore_models(self, s: TS.ModelsState) -> None:
        if s.draft_s is not None:
            self.draft_s.value = s.draft_s
        if s.fallback_bytes is not None:
            self.fallback_bytes.value = s.fallback_bytes
        for mode, v in s.encode_s.items():
            self.encode_s.setdefault(mode, self._ewma()).value = v
        for t, kept in s.temperatures.items():
            side = self.model(t)
            for ratio, (hits, trials) in ((side.long, kept.long), (side.long_gumbel, kept.long_gumbel)):
                weight = min(1.0, self.config.estimates.remembered_positions / trials) if trials > 0 else 0.0
                ratio.hits, ratio.trials = hits * weight, trials * weight
            for k, v in kept.sigma.items():
                side.sigma.setdefault(k, side._ewma()).value = v
            for k, v in kept.packet_bytes.items():
                side.packet_bytes.setdefault(k, side._ewma()).value = v
            side.encoded = kept.encoded
            (side.guess.hits, side.guess.trials), (side.fallback.hits, side.fallback.trials) = kept.guess, kept.fallback

    def model(self, temperature: float) -> _ModelSide:
        t, cfg = float(temperature), self.config.estimates
        side = self.models.get(t)
        if side is None:
            side = self.models[t] = _ModelSide(t == 0, self.config.memory, cfg)
        if not side.tested:  # (a session of edge-only rounds, the bench's warm-up, made it): its prior
            # follows what other temperatures measured
            lent = lent_alpha(self.models, t)
            side.long.hits = (cfg.prior_alpha if lent is None else lent) * side.long.trials
        return side

    # -- the edge ---------------------------------------------------------------------------------------
    def observe_edge_cost(self, points: tuple[tuple[int, float], ...]) -> None:
        """The edge's calibrated cost curve (Welcome.forward_cost) becomes the verify fit's prior."""
        with self.lock:
            self.verify.observe_edge_cost(points)

    # -- encoded distributions ---------------------------------------------------------------------------
    def measure_q(self, q: torch.Tensor, q_hat: torch.Tensor, settings: DraftSettings,
                  temperature: float) -> QStats | None:
        """The measurement of this encoded q where one is due (device/q_measure.py), else None."""
        with self.lock:
            side = self.model(temperature)
            side.encoded += 1
            measured, refresh = Q.due(side.encoded)
        if not measured:
            return None
        return Q.measure(q, q_hat, settings, self._codecs, temperature, refresh)

    def add_q_stats(self, stats: "QStats") -> None:
        """A committed round's measurement of one of its encoded q's."""
        with self.lock:
            side = self.model(stats.temperature)
            for key, tv in stats.sigma.items():
                side.add_sigma(key, tv)
            for key, size in stats.packet_bytes.items():
                side.add_bytes(key, size)

    # -- rounds ------------------------------------------------------------------------------------------
    def observe_round(self, r: RoundRecord, settings: DraftSettings, temperature: float, vocab_size: int,
                      acceptance: SessionAcceptance | None = None, catching_up: bool = False,
                      first: bool = False, gumbel: GumbelAcceptance | None = None, sent_ahead: bool = False,
                      seconds: float = 0.0) -> bool:
        """One round's record; its acceptance also goes to ``acceptance``, its session's (a gumbel
        round's to ``gumbel``, the session's gumbel estimate). ``catching_up``:
        the session's first drafted round, or the first after edge-only rounds: its drafting includes
        feeding the drafter the tokens it has not seen, and its network time the edge's prefill, so
        neither says anything about a round in steady state. ``first``: the session's first round (its
        network time holds the edge's prefill). ``sent_ahead``: an edge-only round requested while the
        one before it streamed (its first token's wait is no round trip). ``seconds``: the round's wall
        time (since the round before it), for which the link went unmeasured unless the round measured
        it (LinkFit.elapse). True if the round stalled on the link (an outage)."""
        forward, queue = r.phases.get("verify", 0.0), r.phases.get("queue", 0.0)
        with self.lock:
            self.rounds_seen += 1
            stalled, unmeasured = False, seconds
            # An edge-only round's network time also holds every streamed token's per-message costs
            # (their sum grows with the round): its first token's is the round-trip sample. Its kind's
            # learned time scale covers those costs instead.
            if not catching_up and settings.mode is not Mode.NONE:
                stalled = self.link.add(r.phases.get("network", 0.0), r.uplink_bytes, r.downlink_bytes,
                                        r.residual_trips)
                unmeasured = 0.0
            elif not first and (wait := first_token_wait(r, settings, sent_ahead)) is not None:
                stalled = self.link.add(wait, r.uplink_bytes, 0)
                unmeasured = seconds - wait  # (it streamed after its sample)
            self.link.elapse(unmeasured)
            if settings.mode is Mode.NONE:
                if r.forward_s:  # the drafter timed while the round streamed (safety_net.NetCall.retime)
                    self._observe_drafter(r, catching_up=False)
                if r.shadow:
                    _observe_shadow(r.shadow, self.model(temperature), acceptance, gumbel)
                if r.shadow_fed:
                    self.shadow_token_s.add(r.shadow_s / r.shadow_fed)
                if r.generated:
                    self.verify.add(1, forward / r.generated)
                    self.queue_s.add(queue / r.generated)
                if r.token_interval_s > 0 and r.generated:
                    # not faster than the edge made them: tokens made ahead (through an outage that
                    # held the round before up) arrive at once
                    self.edge_token_s.add(max(r.token_interval_s, (forward + queue) / r.generated))
                return stalled
            self.verify.add(r.drafted_tokens + 1, forward)
            self.queue_s.add(queue)
            if r.drafted_tokens:
                per_token = {name: r.phases.get(name, 0.0) / r.drafted_tokens for name in ("encode", "decode")}
                self._observe_drafter(r, catching_up)
                # not from a round that catches up: a device's first encoded at 13-17 ms a token, the rounds
                # after it at 1 (first calls' setup), and the EWMA kept that where the mode did not run again
                if not catching_up:
                    self.encode_s.setdefault(settings.mode, self._ewma()).add(per_token["encode"])
                self.decode_s.setdefault(settings.mode, self._ewma()).add(per_token["decode"])
            side = self.model(temperature)
            _observe_acceptance(r, settings, side, acceptance, gumbel)
            if r.drafted_tokens and settings.mode is not Mode.DSSD:
                sent = (r.uplink_bytes - A.PROTO_BYTES_PER_ROUND) / r.drafted_tokens - A.PROTO_BYTES_PER_TOKEN
                side.add_bytes(_codec_key(settings), max(0.0, sent))
            if settings.mode is Mode.DSSD and r.accepted < r.positions:
                side.fallback.add(r.residual_trips > 0)
            if r.residual_trips:
                self.fallback_bytes.add(r.residual_bytes)
            return stalled

    def _observe_drafter(self, r: RoundRecord, catching_up: bool) -> None:
        """The drafter's cost per forward, from each forward that fed one token (a round's mean where
        they were not timed: trees); the nets' drafted arms and the scales made stale by a step. Per forward: a
        round of L drafts takes L + 1 forwards when it feeds the last draft and the bonus one at a time
        (after a full accept, and always when drafted ahead), and the model counts that extra forward
        itself (latency.oracle_time_drafting_ahead)."""
        if r.forward_s:
            samples = r.forward_s
        elif not catching_up:  # (a round that catches up feeds many tokens in one of its forwards)
            samples = (r.phases.get("draft", 0.0) / (r.draft_forwards or r.drafted_tokens),)
        else:
            samples = ()
        for x in samples:
            step = self.draft_s.add(x)
            if step is not None and max(step, 1 / step) >= DRAFTER_CHANGE:
                self.drafter_changes += 1
                self.nets = {t: N.drafter_changed(net, self.config.net) for t, net in self.nets.items()}
                self.time_scale = {}  # (rounds modelled at the old cost: their ratios say it changed)

    def add_round_time(self, key: tuple[Mode, int], measured_s: float, modelled_s: float) -> None:
        """A round took ``measured_s`` where the model said ``modelled_s`` (before any scale)."""
        if modelled_s > 0 and measured_s > 0:
            ratio = min(TIME_SCALE_MAX, max(TIME_SCALE_MIN, measured_s / modelled_s))
            with self.lock:  # (from the model as is: a few rounds do not set a kind's scale)
                self.time_scale.setdefault(key, self._ewma(1.0)).add(ratio)

    def net_start(self, temperature: float) -> N.NetState:
        """A new session's safety net, from what the device's sessions measured at this temperature."""
        with self.lock:
            return N.start_from(self.nets.get(float(temperature), N.NetState()), self.config.net)

    def net_observe(self, temperature: float, arm: str, tokens: int, seconds: float, net: N.NetConfig,
                    **kind) -> None:
        with self.lock:
            t = float(temperature)
            self.nets[t] = N.observe(self.nets.get(t, N.NetState()), net, arm, tokens, seconds, **kind)

    def session_acceptance(self, temperature: float) -> SessionAcceptance:
        """A new session's acceptance estimate, starting from this device's long-run rate."""
        with self.lock:
            return self.model(temperature).session()

    def observe_guess(self, temperature: float, kept: bool) -> None:
        with self.lock:
            self.model(temperature).guess.add(kept)

    def estimates(self, temperature: float, vocab_size: int, acceptance: SessionAcceptance | None = None,
                  fallback_top_k: int = DraftSettings().dssd_fallback_top_k,
                  dssd_samples: int | None = None, gumbel: GumbelAcceptance | None = None) -> A.Estimates:
        """What the choice needs, with ``acceptance`` and ``gumbel`` a session's (by default: a new
        session's)."""
        with self.lock:
            side = self.model(temperature)
            acceptance = acceptance or side.session()
            gumbel = gumbel or GumbelAcceptance(self.config.memory, self.config.estimates)
            gumbel_alpha, gumbel_depth = gumbel.estimate(side.gumbel_prior(acceptance.alpha_base))
            base, slope = self.verify.fit()
            link, down = self.link, self.link.downlink_bps()
            return A.Estimates(
                rtt_s=link.rtt_s(), uplink_bps=link.uplink_bps(), link_measured=link.measured,
                downlink_bps=down if down is not None else link.uplink_bps(),
                draft_s=self.draft_s.value if self.draft_s.value is not None else 0.01,
                verify_base_s=base, verify_per_token_s=slope, alpha_base=acceptance.alpha_base,
                alpha_depth=acceptance.alpha_depth(),
                sigma={k: e.value for k, e in side.sigma.items() if e.value is not None},
                packet_bytes={k: e.value for k, e in side.packet_bytes.items() if e.value is not None},
                encode_s={m: e.value for m, e in self.encode_s.items() if e.value is not None},
                decode_s={m: e.value for m, e in self.decode_s.items() if e.value is not None},
                queue_s=self.queue_s.value or 0.0, edge_token_s=self.edge_token_s.value,
                guess_rate=side.guess.rate,
                dssd_fallback_rate=side.fallback_rate(dssd_samples or self.dssd_samples, acceptance.alpha_base),
                dssd_fallback_bytes=(self.fallback_bytes.value if self.fallback_bytes.value is not None
                                     else float(dssd_fallback_bytes(fallback_top_k, vocab_size))),
                time_scale={k: e.value for k, e in self.time_scale.items() if e.value is not None},
                measured_up_bits=link.measured_up_bits(),
                gumbel_alpha=gumbel_alpha, gumbel_depth=gumbel_depth, greedy=side.greedy,
                edge_chunk=A.edge_chunk(link.rtt_s(), base, self.config.edge_chunk_overhead,
                                        self.config.edge_chunk_min, self.config.edge_chunk_max))


def _observe_acceptance(r: RoundRecord, settings: DraftSettings, side: "_ModelSide",
                        acceptance: SessionAcceptance | None, gumbel: GumbelAcceptance | None) -> None:
    """A round's acceptance teaches both estimates, the exact q's and gumbel's, since both follow the
    same TV of the same text: its own kind's directly, the other through the measured relation
    1 - alpha_gumbel = GUMBEL_TV_FACTOR (1 - alpha) at ``cross_weight``, so that neither goes stale
    while only the other kind runs (a session on gumbel rounds would otherwise keep the exact q's
    acceptance from its first rounds, whatever its text became)."""
    if settings.mode is Mode.GUMBEL:
        raced = [float(d < r.accepted) for d in range(r.tested)]
        exact = [A.exact_from_race(v, side.greedy) for v in raced]
    else:
        tv = side.tv(_codec_key(settings))
        exact = [(d < r.accepted) + tv for d in range(r.tested)]
        raced = [A.race_from_exact(min(1.0, v), side.greedy) for v in exact]
    own_exact = settings.mode is not Mode.GUMBEL
    for ratio, values, own in ((side.long, exact, own_exact), (side.long_gumbel, raced, not own_exact)):
        w = 1.0 if own else side.cfg.cross_weight
        ratio.add(w * max(0.0, sum(values)), w * len(values))  # a round all rejected maps below 0
    if acceptance is not None:
        acceptance.add_positions(exact, 1.0 if own_exact else side.cfg.cross_weight)
    if gumbel is not None:
        gumbel.add_positions(raced, side.cfg.cross_weight if own_exact else 1.0)


def lent_alpha(models: dict[float, "_ModelSide"], temperature: float) -> float | None:
    """A temperature's first acceptance prior: the long-run rate of the nearest temperature that tested
    any position (the same two models; its rate is itself shrunk toward the configured prior, so a few
    positions move it a little), None where none did (the configured prior). The configured 0.8 priced
    a drafter the device had measured at 0.97 at T = 0 below edge-only in its first session at T = 1
    (0.97 there too, once measured), and its one exploration, at the short draft the low prior chose,
    was too short to show otherwise (held-out LIRR, 40 ms)."""
    measured = [(abs(temperature - t), side.long.rate) for t, side in models.items() if side.tested]
    return min(1.0, min(measured)[1]) if measured else None


def shadow_rounds(hits: tuple[int, ...], depth: int) -> list[list[float]]:
    """The rounds a chain of drafts would have made of the positions ``hits`` (1: the drafter's greedy choice
    was the target's token): each from where the last ended to its first miss (the target's token
    replaces it), or ``depth`` hits (the position after them is the bonus, no draft's)."""
    out, i = [], 0
    while i < len(hits):
        run = [float(h) for h in hits[i:i + depth]]
        miss = next((k for k, h in enumerate(run) if not h), None)
        run = run if miss is None else run[:miss + 1]
        out.append(run)
        i += len(run) + (miss is None)
    return out


def shadow_rounds_sampled(values: tuple[float, ...], depth: int) -> list[list[float]]:
    """At T > 0 the positions of a shadow (each an expected acceptance, edge_only.shadow_acceptance), in
    rounds of ``depth``: no draft was drawn, so no position is known rejected where a round would end;
    each depth's estimate gets the expected acceptance there, whatever came before it."""
    return [list(values[i:i + depth]) for i in range(0, len(values), depth)]


def _observe_shadow(shadow: tuple[float, ...], side: "_ModelSide", acceptance: "SessionAcceptance | None",
                    gumbel: "GumbelAcceptance | None") -> None:
    """An edge-only round's shadow (edge_only.catch_up): the acceptance this text would have given
    drafts, per the rounds they would have made, taught to the exact q's estimates and gumbel's. At
    T = 0 (:func:`shadow_rounds`) both accept a draft iff it is the target's argmax; at T > 0
    (:func:`shadow_rounds_sampled`) each position's expected exact-q acceptance, and gumbel's through
    the measured relation (autotune.race_from_exact) at ``cross_weight``, as an exact-q round teaches it.
    Where the session streams edge-only its estimate otherwise stays where its last drafted rounds left
    it (or the device's long-run rate): an easy text was priced at another text's acceptance, and
    drafting that ran 5-10 % faster than edge-only (TSLT-L8, ucc T = 0, the drafter at 1.0x) was never
    chosen."""
    depth, w = side.cfg.max_depth, 1.0 if side.greedy else side.cfg.cross_weight
    for exact in shadow_rounds(shadow, depth) if side.greedy else shadow_rounds_sampled(shadow, depth):
        raced = [A.race_from_exact(v, side.greedy) for v in exact]
        side.long.add(sum(exact), len(exact))
        side.long_gumbel.add(w * sum(raced), w * len(raced))
        if acceptance is not None:
            acceptance.add_positions(exact)
        if gumbel is not None:
            gumbel.add_positions(raced, w)


def first_token_wait(r: RoundRecord, settings: DraftSettings, sent_ahead: bool) -> float | None:
    """An edge-only round's wait for its first token, a round trip (the link's sample, the net's switch
    cost); None for a drafted round, one that streamed nothing, or one whose request went ahead while
    the round before streamed (its first token did not wait for it)."""
    if settings.mode is not Mode.NONE or not r.generated or sent_ahead:
        return None
    return r.first_reply_s


def _codec_key(s: DraftSettings) -> tuple[Mode, int]:
    return s.mode, s.top_k if s.mode in (Mode.TSLT, Mode.KSQS) else 0


@dataclass(frozen=True)
class AutoDecision:
    """What a choice was based on, handed back with the round's event: the time the model predicted
    for the round teaches the learned time scale."""
    candidate: A.Candidate
    estimates: A.Estimates | None  # None: a choice not made from estimates (nothing to learn its time from)


class AutoPolicy:
    """One session's controller: each round's plan from the tracker's estimates.

    It sees the session only through :class:`~specdec.device.rounds.RoundEvent`s, one per committed
    round: :meth:`choose` reads estimates built from committed rounds, so a plan never depends on the
    random numbers of the round it is for (nor on a round drafted ahead on a guess)."""

    def __init__(self, tracker: LinkTracker, hello: Hello, vocab_size: int, draft_ahead: bool = True,
                 reproducible: bool = False):
        self.tracker = tracker
        self.hello = hello
        self.vocab_size = vocab_size
        self.draft_ahead = draft_ahead
        # Seeded and sampling: only rounds whose tokens are a function of (target, prompt, seed, law),
        # so that no choice (each one made from timing) can change them. At T = 0 every round is.
        self.race_only = reproducible and hello.temperature > 0
        self.candidates = self._within(tracker.config.candidates(vocab_size))
        self.dssd_samples = tracker.config.dssd_samples  # within the edge's cap once its Welcome says it
        # its own text's acceptance (sessions running at once share the link, not the text)
        self.acceptance = tracker.session_acceptance(hello.temperature)
        self.gumbel = GumbelAcceptance(tracker.config.memory, tracker.config.estimates)  # its gumbel rounds' (their own event)
        self.current: A.Candidate | None = None  # the model's pick of the round drafted last (hysteresis keeps it)
        self.last: dict = {}          # that round's choice and the estimates behind it (JSON-able)
        self._drafted_last = False    # the last committed round was drafted (False at the start: catch-up)
        self.rounds = 0               # committed rounds of this session
        self.text_positions = 0       # ... and the positions of its text whose acceptance they measured
        self.token_probs = False      # at T > 0, the edge streams each token's p (the shadow's measure)
        self.net_config = N.with_discount(tracker.config.net, tracker.config.memory)
        self.net = tracker.net_start(hello.temperature)  # what each arm delivered (the safety net)
        self._drafter_changes = tracker.drafter_changes  # the drafter's cost steps this net has seen
        self._last_t = 0.0            # when the last round was committed (session seconds)

    def choose(self, in_flight: RoundPlan | None = None, remaining: int | None = None) -> RoundPlan:
        """The next round's plan, from what committed rounds taught the tracker: the model's pick, unless
        the safety net calls the other arm (edge-only or drafted) or a link probe is due. ``in_flight``:
        the plan of a round not yet committed that this one follows (drafted or sent ahead): the net
        counts it among the rounds run (an exploration drafted ahead would run a round longer).
        ``remaining``: the tokens the session still wants after those (None: not known): no exploration
        that the session's end would cut short."""
        e = self.tracker.estimates(self.hello.temperature, self.vocab_size, self.acceptance,
                                   self.hello.draft.dssd_fallback_top_k, self.dssd_samples, self.gumbel)
        pick, ranking = A.best(self.candidates, e, self.current, self.tracker.config.hysteresis, self.draft_ahead)
        cold = (self.rounds == 0 and self.tracker.config.cold_start and not self.tracker.known
                and A.Candidate(Mode.NONE) in self.candidates)
        net = None if cold else self._net_call(pick, ranking, in_flight, remaining, e)
        if cold:
            pick = _best_of_arm(ranking, N.EDGE)
        elif net is not None and net.why is not None:
            pick = _best_of_arm(ranking, net.arm)
        probe = None if cold or (net is not None and net.why) else self._probe(pick, e)
        chosen = probe or pick
        # the text's acceptance measured while it streams (where drafting could pay its cost)
        shadow = chosen.candidate.mode is Mode.NONE and (e.greedy or self.token_probs) and (
            cold or (net is not None and self._shadow_pays(net)))
        chunk, catch_up = self._edge_chunk(chosen, net, e, cold, shadow)
        why = "cold" if cold else "probe" if probe else net.why if net is not None else None
        choice = _explain(chosen, e, ranking, why, chunk, catch_up, net, self.net)
        if chosen.candidate.mode is Mode.NONE and (catch_up or (net is not None and net.retime)):
            # timed where an exploration stands in for one, and before one: a drafter that slowed since
            # it was measured (throttled, a bench's drafter-cost step) is not explored where it cannot pay
            choice["retime"] = RETIME_FORWARDS
        if shadow:
            choice["shadow"] = True
        return RoundPlan(self.settings_for(chosen.candidate, chunk), choice=choice,
                         decision=AutoDecision(chosen.candidate, e), edge_chunk=e.edge_chunk,
                         edge_tail=0 if catch_up else self.tracker.config.edge_chunk_min)

    def _net_call(self, pick: A.Prediction, ranking: list[A.Prediction], in_flight: RoundPlan | None,
                  remaining: int | None, e: A.Estimates) -> N.NetCall | None:
        """The safety net's arm for the next round (None where one arm is not among the candidates)."""
        edge, spec = _best_of_arm(ranking, N.EDGE), _best_of_arm(ranking, N.SPEC)
        if edge is None or spec is None:
            return None
        model_arm = N.EDGE if pick.candidate.mode is Mode.NONE else N.SPEC
        flying = None if in_flight is None else N.EDGE if in_flight.settings.mode is Mode.NONE else N.SPEC
        return N.call(self.net, self.net_config, N.ArmPrior(edge.tokens, edge.seconds),
                      N.ArmPrior(spec.tokens, spec.seconds, self._ceiling(e)), model_arm, flying, remaining,
                      opening=self.rounds == 0 and in_flight is None)

    def _shadow_pays(self, net: N.NetCall) -> bool:
        """Whether an edge-only round should measure the text's acceptance (the shadow): where drafting
        could pay by more than the shadow costs (:func:`safety_net.shadow_pays`), its cost the share of
        edge-only's time that its forwards take, as measured (never measured: taken as none, so that
        it is measured)."""
        cost = self.tracker.shadow_token_s.value
        return net.spec_pays and (cost is None or N.shadow_pays(self.net_config, net.spec_ceiling, net.edge_rate,
                                                                cost * net.edge_rate))

    def _ceiling(self, e: A.Estimates) -> float:
        """Drafted rounds' best case: the best drafted candidate's rate if every draft were accepted
        (the drafter's, the link's and the edge's costs as measured), which no acceptance a round
        measures can exceed."""
        best = _best_of_arm(A.rank(self.candidates, A.accepting_all(e), self.draft_ahead), N.SPEC)
        return best.rate if best is not None else 0.0

    def begin(self, plan: RoundPlan) -> None:
        """A round is drafted with ``plan`` (hysteresis keeps to it, unless the round measures rather
        than chooses: :data:`MEASURING`)."""
        if isinstance(plan.decision, AutoDecision):
            if (plan.choice or {}).get("why") not in MEASURING:
                self.current = plan.decision.candidate
            self.last = dict(plan.choice or {})

    def _probe(self, pick: A.Prediction, e: A.Estimates) -> A.Prediction | None:
        """Goodput is only measured by rounds that carry enough bytes. If none did for a while and a
        fast link would change the choice, run the best-predicted round large enough to measure it."""
        if not self.tracker.link.probe_due() or not A.probe_pays(
                self.candidates, e, pick.candidate, FAST_LINK_BPS, self.tracker.config.probe_min_gain, self.draft_ahead):
            return None
        informative = [p for p in A.rank(self.candidates, e, self.draft_ahead)
                       if A.uplink_bytes(p.candidate, e) >= self.tracker.link.config.min_rate_sample_bytes]
        return informative[0] if informative else None

    def _edge_chunk(self, chosen: A.Prediction, net: N.NetCall | None, e: A.Estimates,
                    cold: bool, shadow: bool) -> tuple[int, bool]:
        """(tokens an edge-only round asks for, whether the drafter should catch up while it streams):
        as the net's next exploration has it (:meth:`_net_chunk`), and where the round reads the text
        (``shadow``), a session's rounds ask for ``edge_chunk_min`` at most until its committed rounds
        measured as many positions of its text as the acceptance prior weighs (``prior_weight``): each
        round's plan is made while the round before streams, and the shadow reads a round's last tokens
        in the next (it feeds ``CATCH_UP_MIN`` at a time, after the prompt),
        so at the usual 32 tokens a round a text easier than the device's last ones streamed 64 of its
        96 tokens edge-only before the model heard of it (held-out nyumets-lirr at T = 0: the session
        after the warm-up ran at 0.60x the best fixed setting, drafting at 15.5 tok/s predicted once it
        knew); at 8 tokens, 24. A boundary costs about a streamed token's gap (the next request goes
        ahead: bench-traces' A/A split)."""
        chunk, catch_up = self._net_chunk(chosen, net, e, cold)
        if shadow and self.text_positions < self.tracker.config.estimates.prior_weight:
            chunk = min(chunk, self.tracker.config.edge_chunk_min)
        return chunk, catch_up

    def _net_chunk(self, chosen: A.Prediction, net: N.NetCall | None, e: A.Estimates,
                   cold: bool) -> tuple[int, bool]:
        """(tokens, catch up) as the net has it. A chunk ends where the net's next exploration of
        drafted rounds becomes due, so that one long edge-only round cannot take the rest of a session;
        the drafter reads the tokens when a drafted round is expected next. Where drafting cannot pay no
        exploration falls due (the drafter is timed instead): a round of ``edge_round_unpaid_s``, as few
        boundaries as that allows."""
        if chosen.candidate.mode is not Mode.NONE:
            return e.edge_chunk, False
        if cold:
            return self.tracker.config.edge_chunk_min, True
        if net is not None and not net.spec_pays and net.edge_rate > 0:
            # drafting that cannot pay is timed, not explored: no round is cut for it, and few boundaries
            unpaid = math.ceil(self.tracker.config.edge_round_unpaid_s * net.edge_rate)
            return max(e.edge_chunk, unpaid), False
        if net is None or not math.isfinite(net.probe_due_s) or net.edge_rate <= 0:
            return e.edge_chunk, False
        # the round may wait for its first token (a request not sent ahead), beyond its tokens' rate
        due = math.ceil(max(0.0, net.probe_due_s - self.net.edge_wait.mean()) * net.edge_rate)
        if due > e.edge_chunk:  # (one that ends just where it is due reads the tokens too)
            return e.edge_chunk, False
        return max(self.tracker.config.edge_chunk_min, due), True

    def settings_for(self, c: A.Candidate, edge_chunk: int) -> DraftSettings:
        base = replace(self.hello.draft, tree=(), bit_budget=0, top_p=0.0)
        if c.mode is Mode.NONE:
            return replace(base, mode=Mode.NONE, edge_tokens=edge_chunk, coupled_bonus=False)
        return replace(base, mode=c.mode, draft_len=c.draft_len, top_k=c.top_k or base.top_k,
                       lattice=self.tracker.config.lattice, dense_dtype="fp16",
                       dssd_samples=self.dssd_samples,
                       coupled_bonus=self.hello.draft.coupled_bonus)

    def observe_welcome(self, welcome: Welcome) -> None:
        """Choose within the edge's limits: a round past its longest draft, largest K or most DSSD
        samples, or of a mode it does not verify (gumbel, before Welcome.modes), would fail the session
        (an edge that does not state its sample cap had 64)."""
        self.candidates = self._within([c for c in self.tracker.config.candidates(
            self.vocab_size, welcome.max_draft_len or DEFAULT_MAX_DRAFT_LEN, welcome.max_k or DEFAULT_MAX_K)
            if welcome.verifies(c.mode)])
        cap = welcome.dssd_max_samples or DEFAULT_DSSD_MAX_SAMPLES
        self.dssd_samples = max(1, min(self.tracker.config.dssd_samples, cap))
        if self.current not in self.candidates:
            self.current = None
        self.tracker.observe_edge_cost(welcome.forward_cost)
        self.token_probs = welcome.token_probs and self.hello.temperature > 0

    def _within(self, candidates: list[A.Candidate]) -> list[A.Candidate]:
        """The candidates this session may choose: the race rounds only where it must be reproducible
        (edge-only is always among them unless configured out; then gumbel alone), and no DSSD round
        in a session that asks for logprobs (a DSSD correction is drawn on the device, without them)
        nor at temperature 0 beside gumbel rounds (:func:`dssd_dominated`)."""
        if self.hello.logprobs != NO_LOGPROBS or dssd_dominated(self.hello.temperature, candidates):
            candidates = [c for c in candidates if c.mode is not Mode.DSSD]
        if not self.race_only:
            return candidates
        race = [c for c in candidates if c.mode in RACE_MODES]
        if not race:
            raise ValueError("a reproducible seeded session needs gumbel or edge-only rounds among auto's candidates")
        return race

    def measure_q(self, q: torch.Tensor, q_hat: torch.Tensor, settings: DraftSettings) -> QStats | None:
        return self.tracker.measure_q(q, q_hat, settings, self.hello.temperature)

    def observe(self, event: RoundEvent) -> None:
        """A committed round: everything auto learns, it learns here."""
        r, settings, t = event.record, event.settings, self.hello.temperature
        drafted = settings.mode is not Mode.NONE
        d = event.plan.decision
        for stats in event.q_stats:
            if stats is not None:
                self.tracker.add_q_stats(stats)
        if event.guess is not None:
            self.tracker.observe_guess(t, event.guess)
        seconds = max(0.0, event.t - self._last_t)  # since the last committed round
        self._last_t = event.t
        stalled = self.tracker.observe_round(r, settings, t, self.vocab_size, self.acceptance,
                                             catching_up=drafted and not self._drafted_last, first=self.rounds == 0,
                                             gumbel=self.gumbel, sent_ahead=event.sent_ahead, seconds=seconds)
        if (isinstance(d, AutoDecision) and d.estimates is not None and d.estimates.link_measured and drafted
                and self._drafted_last and self.rounds > 0 and not stalled):
            # the round's wall time against the model's (not a round that catches the drafter up, nor
            # one an outage held up: that says nothing about its kind of round; nor one modelled before
            # any round measured the link, whose round trip the model took as 0: a device's first
            # drafted rounds, 0.07-0.09 s modelled against 0.20 s, set gumbel's scale to 1.34 for good,
            # and drafting's best case fell below edge-only's rate; edge-only rounds are measured by how
            # they streamed, A.time_scale)
            modelled = A.first_round(d.candidate, d.estimates, event.ahead_steps, self.draft_ahead, event.sent_ahead)
            self.tracker.add_round_time(d.candidate.codec_key, event.elapsed_s, modelled)
        changed = self.tracker.drafter_changes != self._drafter_changes  # (this session's rounds or another's)
        if changed:
            self._drafter_changes = self.tracker.drafter_changes
            self.net = N.drafter_changed(self.net, self.net_config)
        self._observe_net(event, drafted, seconds, changed)
        self._drafted_last = drafted
        self.rounds += 1
        self.text_positions += r.positions + len(r.shadow)

    def skip(self, event: RoundEvent) -> None:
        """A round auto learns nothing from (tokens the edge generated ahead through an outage or a
        stall, and the round they superseded): its time is the link's, not its kind of round's, so the
        safety net's next sample starts after it instead of carrying it."""
        self._last_t = event.t

    def _observe_net(self, event: RoundEvent, drafted: bool, seconds: float, drafter_changed: bool = False) -> None:
        """The round's tokens and wall ``seconds`` (since the last committed round) to the safety net, here
        and on the device (where the next sessions start): the session's first round (the prefill) and
        a drafted round that catches the drafter up (a switch's cost) apart, as is one drafted only after
        the verdict before it because the plan made ahead of that verdict was edge-only
        (``RoundEvent.declined_ahead``: the cost of the net's own wavering, not of drafted rounds; counted
        as the arm's, a net near its threshold drafted every other round ahead, 0.38 s against 0.17 s
        for the same tokens, and priced drafting below edge-only by it), and an edge-only round's
        wait for its first token unless its request went ahead (a switch's cost too), whether it
        was planned as an exploration (what explorations cost is measured), and whether it timed the
        drafter in place of an exploration (which is done then; not a round timing it before one, which
        catches the drafter up for it), unless that found the drafter's cost changed:
        then the exploration stays due, and the next round explores the drafter as it now is (or
        times it again), where the clock restarted would keep a drafter that got faster unexplored
        for another 25-100 s."""
        arm = N.SPEC if drafted else N.EDGE
        kind = dict(first=self.rounds == 0, switch=drafted and (not self._drafted_last or event.declined_ahead),
                    wait_s=first_token_wait(event.record, event.settings, event.sent_ahead),
                    explore=(event.plan.choice or {}).get("why") == "explore",
                    stall_s=event.record.stream_stall_s, busy_s=0.0 if drafted else _edge_busy_s(event.record),
                    retimed=(not drafted and bool(event.record.forward_s) and not drafter_changed
                             and not (event.plan.choice or {}).get("catch_up")))
        tokens = event.record.generated
        self.net = N.observe(self.net, self.net_config, arm, tokens, seconds, **kind)
        self.tracker.net_observe(self.hello.temperature, arm, tokens, seconds, self.net_config, **kind)


def dssd_dominated(temperature: float, candidates: list[A.Candidate]) -> bool:
    """Whether a DSSD round loses to a gumbel round of its length whatever the link and devices: at
    temperature 0 both draft the drafter's argmax and the edge accepts exactly the drafts that are the
    target's argmax, so they deliver the same tokens per round; DSSD sends more (its q scalars), and
    the edge neither runs ahead after a DSSD round through an outage nor serves one late (its correction
    may be the device's: run_ahead.after_ms, verifier.continues_like). Chosen between them by their
    learned time scales (noise: an outage met by one kind's round), auto sent DSSD rounds into a 1.8 s
    uplink outage that the edge sat out."""
    return temperature == 0 and any(c.mode is Mode.GUMBEL for c in candidates)


def _edge_busy_s(r: RoundRecord) -> float:
    """The edge's seconds on a round's tokens: its forwards and its queue (the tokens cannot have
    streamed faster in steady state)."""
    return r.phases.get("verify", 0.0) + r.phases.get("queue", 0.0)


def _best_of_arm(ranking: list[A.Prediction], arm: str) -> A.Prediction | None:
    """The best-ranked prediction of the safety net's ``arm`` (edge-only rounds, or drafted rounds of any
    setting), None where no candidate is of it."""
    return next((p for p in ranking if (p.candidate.mode is Mode.NONE) == (arm == N.EDGE)), None)


def _explain(chosen: A.Prediction, e: A.Estimates, ranking: list[A.Prediction], why: str | None, chunk: int,
             catch_up: bool, net: N.NetCall | None = None, state: N.NetState | None = None) -> dict:
    """The choice and the estimates behind it, for the JSON round log and the metrics. ``why``: what
    overrode the best-predicted choice (cold, probe, net, explore), if anything. The model's best
    prediction for each arm, the net's wait before its next exploration and its losing streaks say why
    an arm ran on (a pick's own prediction alone does not)."""
    edge, spec = _best_of_arm(ranking, N.EDGE), _best_of_arm(ranking, N.SPEC)
    return {
        "choice": chosen.candidate.key, "mode": chosen.candidate.mode.value, "draft_len": chosen.candidate.draft_len,
        "top_k": chosen.candidate.top_k, "predicted_tokens_per_s": chosen.rate, "alpha": chosen.alpha,
        "probe": why == "probe", "why": why, "edge_tokens": chunk if chosen.candidate.mode is Mode.NONE else 0,
        "catch_up": catch_up, "runner_up": ranking[1].candidate.key if len(ranking) > 1 else None,
        "rtt_s": e.rtt_s, "uplink_bps": _finite(e.uplink_bps), "downlink_bps": _finite(e.downlink_bps),
        "draft_s": e.draft_s, "verify_base_s": e.verify_base_s, "verify_per_token_s": e.verify_per_token_s,
        "edge_token_s": e.edge_token_s,
        "alpha_base": e.alpha_base, "guess_rate": e.guess_rate, "edge_chunk": e.edge_chunk,
        "time_scale": A.time_scale(chosen.candidate, e),
        "net_edge_tokens_per_s": net.edge_rate if net is not None else None,
        "net_spec_tokens_per_s": net.spec_rate if net is not None else None,
        "model_edge_tokens_per_s": edge.rate if edge is not None else None,
        "model_spec_tokens_per_s": spec.rate if spec is not None else None,
        "probe_due_s": net.probe_due_s if net is not None and math.isfinite(net.probe_due_s) else None,
        "spec_lost": state.spec_lost if state is not None else None,
        "edge_lost": state.edge_lost if state is not None else None,
        # what explorations of each arm were measured to cost (the least they are priced at)
        "spec_probe_cost_s": state.spec_probe.mean() if state is not None else None,
        "edge_probe_cost_s": state.edge_probe.mean() if state is not None else None,
        "spec_pays": net.spec_pays if net is not None else None,
        # what the best case and the learned scales were (why drafting was or was not explored)
        "spec_ceiling_tokens_per_s": net.spec_ceiling if net is not None else None,
        "time_scales": {f"{m.value}-{k}": v for (m, k), v in e.time_scale.items()},
        "encode_s": {m.value: v for m, v in e.encode_s.items()},
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) and x < FAST_LINK_BPS else None
