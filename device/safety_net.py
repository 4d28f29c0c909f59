"""Mode auto's safety net: what speculating delivered, against what edge-only delivers, both measured.

Mode auto's model (:func:`specdec.device.autotune.best`) predicts each candidate's rate from fitted
costs. Where a fit misses (a device slower than assumed, a drafter competing for its cores, a link
unlike the model's), its pick can be slower than not speculating at all, and nothing in the model
notices. The net needs no model of the world. It keeps, for each of two arms, edge-only rounds and
drafted rounds (whatever their setting), the tokens its committed rounds delivered and the wall-clock
seconds they took (from one committed round to the next: drafting, encoding, waiting, fallbacks all
in), and plays the arms as a two-armed bandit:

* estimates are discounted sums, as in D-UCB (Garivier & Moulines, "On Upper-Confidence Bound Policies
  for Switching Bandit Problems", ALT 2011, eq. 2), discounted per round of their own arm: an arm's
  last ~1 / (1 - ``discount``) rounds make its estimate. The model's prediction for the arm is its
  prior, weighing ``prior_rounds`` rounds. An arm that does not run keeps its estimate (D-UCB lets it
  fade back to the prior, and an optimistic prior would then be retried every few rounds); what it
  may have become is found by exploring it;
* the model's arm runs unless the arms' estimates contradict it by ``confidence`` standard errors (the
  spread of the rounds' own rates): the drafted arm must beat edge-only by ``margin``, since the
  promise is never to be slower than not speculating, and a few unlucky rounds must not override a
  model that is right;
* the other arm is probed at a priced rate (UCB's optimism, priced instead of indexed): once the current
  arm has run ``1 / explore_cost`` times what a probe is expected to lose (the other arm's measured
  shortfall over its probe), so probing costs about ``explore_cost`` of the time whichever arm is worse.
  A drafted probe lasts ``probe_rounds`` rounds: its first catches the drafter up (a switch's cost, kept
  out of the arm's rate), the next measure it; the first of a drafter never measured lasts
  ``fresh_rounds`` (one round is too few to judge an arm by);
* each arm is judged by what it delivers once it runs: an edge-only round whose request was not sent
  ahead (after a drafted round, or with drafting ahead off) waits a round trip for its first token,
  where edge-only in steady state streams on without one (each request goes out while the round before
  streams). That wait is a switch's cost, as the drafted catch-up round is: kept out of the edge-only
  arm's rate and priced into the explorations that cause it. Counted in, short edge-only explorations
  (a round trip in 8 tokens) made edge-only look 20-50 % slower than it streams, and the net kept
  drafting where edge-only was faster.
* an exploration is priced at least at what the last ones cost: from its first round to the first
  round of the arm it came back to, the seconds taken beyond what that arm's measured rate gives the
  same tokens. Costs the model of a probe leaves out are in it: a round drafted ahead while the
  probe's last was verified, an edge-only round cut short to make room for it, a return that waits.
* drafting that the model now predicts faster than edge-only (:func:`claims`: its prediction holds this
  text's acceptance, the arm's rounds other texts' and draft lengths') is explored at the least price,
  ``margin`` of a probe, until explorations are measured to lose (then at what they cost, as above).
* an arm whose explorations lost ``k`` times in a row is explored at ``explore_cost / (1 + k)`` (k up
  to ``backoff``): at a fixed share, exploring a drafter that never pays (one slower than the target)
  cost 2-4 % of the time for ever, where UCB's explorations of an arm measured worse thin out.
* drafting whose best case loses (every draft accepted, at the drafter's measured cost:
  ``ArmPrior.ceiling``) is not explored: no acceptance a drafted round could measure makes it pay, and
  the link's and the edge's costs in that best case are measured by the edge-only rounds themselves.
  What could change is the drafter's cost (a device that stopped throttling, another app gone), so
  where an exploration of it falls due the net asks for the drafter to be timed instead
  (``NetCall.retime``: a few forwards while an edge-only round streams, costing no wall time) and
  restarts its clock once it was. Explored regardless, drafted rounds at 1.5x the target's cost per
  token lost 6-20 % of the sessions they ran in.

Pure: no clock, no model; the rounds' times come in with their events.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

EDGE, SPEC = "edge", "spec"  # the arms, named as their sums in NetState
PROBE_COST = {SPEC: "spec_probe", EDGE: "edge_probe"}  # NetState's field of what exploring each arm cost
SUMS = (EDGE, SPEC, "switch", "spec_steady")    # NetState's Sums: the arms', the catch-up rounds', steady drafting's
COSTS = ("edge_wait", *PROBE_COST.values())     # NetState's Costs: first-token waits, explorations
LOST = {SPEC: "spec_lost", EDGE: "edge_lost"}   # NetState's field of how many explorations of each lost in a row


@dataclass(frozen=True)
class NetConfig:
    """Why these values: each is a share, a count of rounds or a ratio, the same on any device and link."""
    discount: float = 0.95      # per round of the arm: its last ~20 rounds make its estimate (a drafted
                                # round's tokens run from 1 to L + 1: fewer rounds are too noisy to judge by)
    prior_rounds: float = 0.5   # the model's prediction weighs half a measured round: a few rounds
                                # outweigh a model that is wrong
    margin: float = 0.03        # drafting must beat edge-only by this share (noise alone must not keep it)
    confidence: float = 1.0     # standard errors by which the rounds must contradict the model to override it
    prior_cv: float = 0.5       # spread of a drafted round's rate around its arm's, before rounds show it
                                # (one round of it): a drafted round's tokens run from 1 to L + 1
    edge_prior_cv: float = 0.1  # ... of an edge-only round's: its rate is the mean of its 8 or more tokens'
                                # intervals, the edge's forward each (the bench's links: 1-3 % within a
                                # session, stalls out). At the drafted rounds' 0.5, four edge-only rounds
                                # weighed as a standard error of ~8 % of their rate, and drafting measured
                                # 3-8 % slower ran on where the model favoured it
    explore_cost: float = 0.02  # share of the time exploring the worse arm may cost
    probe_rounds: int = 2       # drafted rounds per exploration: one catches up, one is measured
    fresh_rounds: int = 3       # ... of drafting never measured: one catches up, two are measured (one
                                # round's tokens run from 1 to L + 1: a text rejected at its first draft
                                # once priced a drafter at 0.6x edge-only, and the session ran edge-only)
    optimism: float = 0.5       # an arm measured over n rounds is priced as if up to 0.5 / sqrt(n + prior)
                                # faster (UCB1's bonus): an arm the model thinks poor is still explored soon
    start_rounds: float = 4.0   # the most a new session's start (the device's sums) weighs, in rounds
    priced_by_cost: bool = True  # explorations priced at least at what the last ones cost (False: at
                                 # the modelled price alone, the tests' control)
    model_claims: bool = True   # drafting the model predicts faster than edge-only is explored at the
                                # least price unless explorations measured it losing (False: the control)
    backoff: int = 3            # explorations of an arm that lost its last k in a row are priced at
                                # explore_cost / (1 + k), k at most this: an arm measured worse again and
                                # again is explored ever more rarely (UCB's index grows as log t and the
                                # rounds' sum as n, so its explorations thin out with n), while discounting
                                # keeps the net able to notice a change: the wait grows at most 4x
    forgive: int = 1            # lost explorations in a row that steady rounds measured better excuse from the
                                # backoff (:func:`backoff`): one unlucky text, not a streak
    changed_rounds: float = 0.5  # drafted rounds measured before the drafter's cost stepped weigh at most
                                 # this many rounds (as the model's prediction, which knows the new cost):
                                 # they measured a drafter that no longer runs (drafter_changed)
    outlier: float = 3.0        # a round counts at most this many times what its arm's rounds take: an
                                # outage met in flight (seconds on a recorded cellular link) would
                                # otherwise set the arm's rate for many rounds, and it says nothing
                                # about the arm (the link is down for either)


@dataclass(frozen=True)
class Sums:
    """Discounted tokens, seconds and rounds of one arm, and its rounds' own rates (sum and squares:
    their spread says how sure the estimate is)."""
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0
    rates: float = 0.0
    rates_sq: float = 0.0

    def scaled(self, f: float) -> "Sums":
        return Sums(self.tokens * f, self.seconds * f, self.rounds * f, self.rates * f, self.rates_sq * f)

    def at_most(self, rounds: float) -> "Sums":
        """The same rates, weighing at most ``rounds`` rounds."""
        return self.scaled(min(1.0, rounds / self.rounds)) if self.rounds > 0 else self

    def plus(self, tokens: float, seconds: float, discount: float) -> "Sums":
        r = tokens / seconds
        d = self.scaled(discount)
        return Sums(d.tokens + tokens, d.seconds + seconds, d.rounds + 1.0, d.rates + r, d.rates_sq + r * r)

    def rate(self, prior_rate: float, prior_rounds: float) -> float:
        """Tokens per second delivered, averaged with ``prior_rate`` weighing ``prior_rounds`` rounds."""
        if self.seconds <= 0:
            return prior_rate
        return (self.rounds * self.tokens / self.seconds + prior_rounds * prior_rate) / (self.rounds + prior_rounds)

    def stderr(self, rate: float, prior_rounds: float, prior_cv: float) -> float:
        """The estimate's standard error: the spread of the rounds' rates around ``rate``, with
        ``prior_rounds`` of spread ``prior_cv * rate`` added (one round shows no spread), over the root
        of the rounds."""
        n = self.rounds + prior_rounds
        spread = self.rates_sq - 2 * rate * self.rates + self.rounds * rate * rate  # sum of (r - rate)^2
        return math.sqrt(max(0.0, spread + prior_rounds * (prior_cv * rate) ** 2) / n / n)

    def per_round(self) -> tuple[float, float] | None:
        """(tokens, seconds) of an average round, None before any."""
        return (self.tokens / self.rounds, self.seconds / self.rounds) if self.rounds > 0 else None


@dataclass(frozen=True)
class Cost:
    """A kind of event's discounted seconds and count: their mean is what the next one is expected to cost."""
    seconds: float = 0.0
    count: float = 0.0

    def plus(self, seconds: float, discount: float) -> "Cost":
        return Cost(self.seconds * discount + seconds, self.count * discount + 1.0)

    def scaled(self, f: float) -> "Cost":
        return Cost(self.seconds * f, self.count * f)

    def mean(self) -> float:
        """Seconds one event is expected to cost (0 before any: none was seen to cost anything)."""
        return self.seconds / self.count if self.count > 0 else 0.0


@dataclass(frozen=True)
class Episode:
    """An exploration under way: the arm explored, the tokens and seconds of its rounds so far, whether
    a session's first round began it (kept out: it holds the prefill), and whether the arm had never
    been measured when it began (it runs :func:`probe_rounds` of a fresh arm)."""
    arm: str
    tokens: float = 0.0
    seconds: float = 0.0
    partial: bool = False
    fresh: bool = False


@dataclass(frozen=True)
class ArmPrior:
    """The model's prediction for an arm's next round: tokens and seconds (autotune.Prediction's), and
    its best case: the rate it would deliver if every draft were accepted (inf: unbounded, edge-only)."""
    tokens: float
    seconds: float
    ceiling: float = math.inf

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class NetCall:
    """The net's call for the next round: the arm, and why it overrides the model's pick (None: it does not)."""
    arm: str
    why: str | None
    edge_rate: float
    spec_rate: float
    probe_due_s: float   # seconds of the current arm before the other is explored (inf: not counting)
    spec_pays: bool = True  # drafting's best case beats edge-only (it is explored, not timed)
    retime: bool = False    # an exploration of drafting that cannot pay is due: time the drafter instead
    spec_ceiling: float = 0.0  # the best case ``spec_pays`` was judged by (ArmPrior.ceiling), tokens/s


@dataclass(frozen=True)
class NetState:
    """One session's net: the arms' sums, the drafted rounds that caught the drafter up and the edge-only
    rounds' first-token waits (a switch's costs, either way), and the run of the arm that ran last."""
    edge: Sums = Sums()
    spec: Sums = Sums()
    switch: Sums = Sums()
    last_arm: str | None = None
    run_s: float = 0.0        # seconds of last_arm's rounds since the other arm ran
    run_rounds: int = 0       # ... and their count
    edge_wait: Cost = Cost()  # an edge-only round's wait for its first token when not sent ahead
    spec_probe: Cost = Cost()  # what explorations of drafted rounds cost, return included
    edge_probe: Cost = Cost()  # ... of edge-only rounds
    episode: Episode | None = None  # the exploration under way, if any
    spec_lost: int = 0        # explorations of drafted rounds that lost, in a row (a win resets it)
    edge_lost: int = 0        # ... of edge-only rounds
    spec_steady: Sums = Sums()  # drafted rounds neither catching up nor exploring (:func:`_measured_better`)

    def lost(self, arm: str) -> int:
        return getattr(self, LOST[arm])

    def sums(self, arm: str) -> Sums:
        """``arm``'s sums (EDGE, SPEC; "switch": the catch-up rounds')."""
        return getattr(self, arm)

    def measured(self, arm: str) -> bool:
        """Whether any round of ``arm`` was measured (a drafter never measured is explored at once, and
        longer: :func:`probe_wait_s`, :func:`probe_rounds`)."""
        return self.sums(arm).rounds > 0

    def probe_cost(self, arm: str) -> Cost:
        return getattr(self, PROBE_COST[arm])


def remembered(device: NetState) -> NetState:
    """What a new process keeps of the device's net (device/edge_memory.py): the arms' sums and the
    costs measured; not the run or an exploration under way, which were this process's."""
    return NetState(**{name: getattr(device, name) for name in (*SUMS, *COSTS, *LOST.values())})


def start_from(device: NetState, cfg: NetConfig) -> NetState:
    """A new session's net: the device's sums, weighing at most ``start_rounds`` rounds each (the
    session's text may accept differently), and the device's run, so that exploring is priced over the
    device's time, not restarted by each session (short sessions would otherwise never explore)."""
    def few(c: Cost) -> Cost:
        return c.scaled(min(1.0, cfg.start_rounds / c.count)) if c.count > 0 else c
    return replace(device, **{name: device.sums(name).at_most(cfg.start_rounds) for name in SUMS},
                   **{name: few(getattr(device, name)) for name in COSTS})


def drafter_changed(state: NetState, cfg: NetConfig) -> NetState:
    """The drafter's cost per forward stepped (auto.DRAFTER_CHANGE): what drafted rounds delivered
    before (the arm's sums, its steady rounds', its catch-up rounds') weighs at most
    ``changed_rounds`` rounds, so that the model's prediction at the new cost and the next rounds
    decide, not rounds of another drafter. Kept at their costs: an exploration still costs what it
    did, give or take the drafter's part."""
    return replace(state, **{name: state.sums(name).at_most(cfg.changed_rounds)
                             for name in (SPEC, "spec_steady", "switch")})


def observe(state: NetState, cfg: NetConfig, arm: str, tokens: int, seconds: float, *, first: bool = False,
            switch: bool = False, wait_s: float | None = None, explore: bool = False,
            stall_s: float = 0.0, retimed: bool = False, busy_s: float = 0.0) -> NetState:
    """One committed round of ``arm``: ``tokens`` in ``seconds`` of wall time. A session's ``first``
    round (it holds the prefill) is kept out of the sums, a drafted round that catches the drafter up
    (``switch``) goes to the switch's sums; both count in the run. ``wait_s``: an edge-only round not
    sent ahead waited this long for its first token (a round trip that streaming edge-only does not
    wait): kept out of the arm's time, kept as a switch's cost. A round counts at most ``outlier`` times
    what its arm's rounds usually take (:func:`usual_seconds`; in the sums; the run takes its wall time).
    ``explore``: the round was planned as an exploration (its cost is measured: :func:`_episode`).
    ``stall_s``: seconds the link held the round's stream up (an outage, edge_only.Arrivals.stall): kept
    out of the arm's time and of an exploration's cost; the link is down for either arm. ``retimed``: the
    drafter was timed during the round (``NetCall.retime``), which stands for the exploration due: the
    run's clock restarts. ``busy_s``: the edge's seconds on an edge-only round's tokens (its forwards
    and queue), which the round counts at least: tokens the edge made ahead (through an outage that
    held the round before up) arrive at once, and counted at their arrival a round of 42 such tokens
    priced edge-only at 96 tok/s where it streamed at 18, its outage already left out of the round
    before."""
    kept = "switch" if switch else arm
    mine = state.sums(kept)
    wait = min(max(0.0, wait_s or 0.0), seconds)
    steady = seconds - wait - min(max(0.0, stall_s), seconds - wait)
    counted = min(steady, cfg.outlier * usual_seconds(mine, arm, tokens))
    if arm == EDGE:
        counted = max(counted, busy_s)
    changes = {kept: mine.plus(tokens, counted, cfg.discount)} if not first and counted > 0 else {}
    if changes and arm == SPEC and not switch and not explore:
        changes["spec_steady"] = state.spec_steady.plus(tokens, counted, cfg.discount)
    if wait_s is not None and not first:
        changes["edge_wait"] = state.edge_wait.plus(wait, cfg.discount)
    changes.update(_episode(state, cfg, arm, tokens, counted + wait, explore, first, wait))
    same = arm == state.last_arm
    run_s = 0.0 if retimed else (state.run_s if same else 0.0) + seconds
    return replace(state, **changes, last_arm=arm, run_s=run_s, run_rounds=(state.run_rounds if same else 0) + 1)


def usual_seconds(sums: Sums, arm: str, tokens: int) -> float:
    """What a round of ``arm`` delivering ``tokens`` usually takes, by its sums (inf before any): an
    edge-only round's time grows with the tokens it streams; a drafted round's does not (a round
    rejected at its first draft takes as long as one accepted whole, and delivers one token), so
    a drafted round is measured against its arm's average round, not its tokens' share of it."""
    if sums.rounds <= 0 or sums.tokens <= 0:
        return math.inf
    if arm == EDGE:
        return tokens * sums.seconds / sums.tokens
    return sums.seconds / sums.rounds


def _episode(state: NetState, cfg: NetConfig, arm: str, tokens: int, seconds: float, explore: bool,
             first: bool, wait: float = 0.0) -> dict:
    """The exploration's account after a round: an exploration's rounds add to it; the first round of
    the other arm after it closes it, its cost the seconds beyond what that arm's measured rate gives
    all their tokens (of an edge-only round coming back, only its wait for the first token: its stream
    measures edge-only, not the exploration, and 30-40 tokens streaming 15 % faster than the arm's
    average made a drafted exploration that lost 0.2 s a win); a cost above 0 (the exploration lost
    time, its switches in) lengthens the arm's losing streak, one at most 0 ends it. Neither the
    exploration's one measuring round (drafted ahead and accepted, it flatters a drafter: the streak
    flipped on noise) nor the arm's measured rate (its sums forget only as the arm runs: a device whose
    drafter slowed kept its faster past) judges it as well. One a session's first round began lacks its
    catch-up (kept out with the prefill): priced as measured, it leaves the streak as it was (its sign
    is noise; :func:`call` begins none there). The explored arm running on (it won: its streak ends) or
    a session's first round of the other arm (the prefill's) drop it unpriced."""
    ep = state.episode
    if explore:
        ep = ep if ep is not None and ep.arm == arm else Episode(arm, fresh=not state.measured(arm))
        if first:
            return {"episode": replace(ep, partial=True)}
        return {"episode": replace(ep, tokens=ep.tokens + tokens, seconds=ep.seconds + seconds)}
    if ep is None:
        return {}
    back = state.sums(arm)
    if first or back.tokens <= 0:
        return {"episode": None}
    if arm == ep.arm:  # the explored arm runs on: it won
        return {"episode": None, LOST[ep.arm]: 0}
    if arm == EDGE:
        tokens, seconds = 0, wait
    cost = ep.seconds + seconds - (ep.tokens + tokens) * back.seconds / back.tokens
    streak = state.lost(ep.arm) if ep.partial else state.lost(ep.arm) + 1 if cost > 0 else 0
    return {"episode": None, PROBE_COST[ep.arm]: state.probe_cost(ep.arm).plus(cost, cfg.discount),
            LOST[ep.arm]: streak}


def call(state: NetState, cfg: NetConfig, edge: ArmPrior, spec: ArmPrior, model_arm: str,
         in_flight: str | None = None, remaining: int | None = None, opening: bool = False) -> NetCall:
    """The arm of the next round, given the model's predictions for both (the priors) and its pick: the
    model's arm unless what the arms delivered says, by ``confidence`` standard errors, that the other
    is faster (drafting counted ``margin`` slower): a few unlucky rounds (a text rejected at depth 1
    three times) must not override a model that is right, and a model that is wrong is overridden as
    soon as the rounds say so. ``in_flight``: the arm of a round planned but not committed yet (this one
    is planned ahead of its verdict): it counts in the run, so an exploration runs its rounds, not one
    more drafted ahead. ``remaining``: the tokens the session still wants (None: not known); an
    exploration starts only if its rounds fit in them, since one cut short by the session's end pays
    its switch and measures nothing. ``opening``: the round is a session's first; no exploration
    begins there or goes on from the session before: that round holds the prefill and stays out of
    every sum, so an exploration it began went unpriced (its catch-up, the drafter reading the prompt,
    uncounted) and never lengthened the losing streak. Explorations deferred by a session's end ran
    first thing in the next, so a drafter that never paid was explored at the full share, every
    session. An exploration of drafting that cannot pay (:func:`spec_pays`) is not run: where it falls
    due, the call says ``retime`` (time the drafter while edge-only streams) instead."""
    r_edge = state.edge.rate(edge.rate, cfg.prior_rounds)
    r_spec = state.spec.rate(spec.rate, cfg.prior_rounds)
    se = math.hypot(state.edge.stderr(r_edge, cfg.prior_rounds, cfg.edge_prior_cv),
                    state.spec.stderr(r_spec, cfg.prior_rounds, cfg.prior_cv))
    lead = r_spec - r_edge * (1 + cfg.margin)   # drafting's measured lead over edge-only
    if model_arm == SPEC:
        better = EDGE if lead + cfg.confidence * se < 0 else SPEC
    else:
        better = SPEC if lead - cfg.confidence * se > 0 else EDGE
    other = EDGE if better == SPEC else SPEC
    due = probe_wait_s(state, cfg, other, edge, spec, r_edge, r_spec) - state.run_s
    last, runs = state.last_arm, state.run_rounds
    if in_flight is not None:
        last, runs = in_flight, (runs + 1 if in_flight == last else 1)
    going_on = last == other and runs < probe_rounds(state, cfg, other)  # rounds not all run yet
    starting = last is not None and last != other and due <= 0 and fits(state, cfg, other, spec, remaining)
    pays = spec_pays(state, cfg, spec, r_edge)
    if not opening and (going_on or (starting and (other == EDGE or pays))):
        arm, why = other, "explore"
    else:
        arm, why = better, None if better == model_arm else "net"
    retime = arm == EDGE and other == SPEC and not pays and due <= 0
    return NetCall(arm, why, r_edge, r_spec, due if last == better else math.inf, pays, retime, spec.ceiling)


def spec_pays(state: NetState, cfg: NetConfig, spec: ArmPrior, r_edge: float) -> bool:
    """Whether drafting could beat edge-only's ``r_edge``: its best case does (:func:`could_pay`), or its
    steady rounds measured better (evidence outranks the model the best case comes from), a round's
    worth of them at least: after the drafter's cost stepped (:func:`drafter_changed`) its older rounds
    weigh half a round at their old rate, and the rate of a drafter at 1.0x the target's cost kept one
    at 1.5x explored (two DSSD-L1 rounds, 0.94-0.95x edge-only in those sessions)."""
    return could_pay(spec, r_edge, cfg) or (_measured_better(state, cfg, SPEC) and state.spec_steady.rounds >= 1.0)


def shadow_pays(cfg: NetConfig, ceiling: float, r_edge: float, cost_share: float) -> bool:
    """Whether measuring the text's acceptance while edge-only streams (mode auto's shadow, at T = 0)
    is worth ``cost_share`` of edge-only's time: whether drafting's best case ``ceiling`` beats
    ``r_edge`` by ``margin`` and that share. The shadow's forwards read every streamed token with every
    position's logits (bench-traces' round logs: 7-10 ms a token read with the drafter slowed to
    0.6-1.0x the target's cost, against edge-only's ~54 ms a token); where drafting could gain less
    than that, what the shadow finds is worth less than it costs a host the edge shares (there it
    slowed edge-only sessions by 4-5 % where drafting's best case was 8 % up). The best case alone: an
    acceptance the shadow measures moves the model's prices no higher, and drafted rounds that
    measured faster need no shadow to be run (the net runs them on that evidence). Nor did they keep
    it on well: edge-only rounds slowed by the shadow measured drafting ahead (18.2 against 17.2
    tok/s), so the shadow kept itself on."""
    return ceiling > (1 + cfg.margin + cost_share) * r_edge


def probe_rounds(state: NetState, cfg: NetConfig, arm: str) -> int:
    """Rounds an exploration of ``arm`` runs: edge-only's one (a round of 8 tokens or more measures how
    it streams); drafting's ``probe_rounds``, or ``fresh_rounds`` while it was never measured (the
    exploration under way began so, or none is under way and the arm has no measured round: its
    first round may be in flight, uncommitted): a drafted round delivers 1 to L + 1 tokens in about
    the same time, and one rejected at its first draft priced the arm at a fraction of its rate."""
    if arm == EDGE:
        return 1
    ep = state.episode
    fresh = ep.fresh if ep is not None and ep.arm == arm else not state.measured(arm)
    return cfg.fresh_rounds if fresh else cfg.probe_rounds


def fits(state: NetState, cfg: NetConfig, arm: str, spec: ArmPrior, remaining: int | None) -> bool:
    """Whether an exploration of ``arm`` fits in ``remaining`` tokens (None: no end known): a drafted
    one's rounds as the model predicts them (its first only catches the drafter up); an edge-only one
    always (a shorter round still measures how edge-only streams)."""
    if remaining is None or arm == EDGE:
        return True
    return remaining >= probe_rounds(state, cfg, arm) * spec.tokens


def probe_wait_s(state: NetState, cfg: NetConfig, arm: str, edge: ArmPrior, spec: ArmPrior, r_edge: float,
                 r_spec: float) -> float:
    """Seconds of the better arm that pay for exploring ``arm``: what the exploration is expected to
    lose against the better arm (at the measured rates, the switch back and forth included: a catch-up
    round as the last ones took, an edge-only round's first-token wait as the last ones waited), or
    what the last explorations of ``arm`` cost where that is more, at least ``margin`` of its time, so
    that two arms as fast as each other do not swap every round; over ``explore_cost``. Drafted
    rounds this device never measured (at this temperature) are due at once, as UCB1 plays each arm
    once before any index (Auer et al. 2002): their price is the model's guess (acceptance priors),
    and priced against measured edge-only, a catch-up round included, it kept a drafter at 2x
    edge-only's speed untried for 13 s. Not where even their best case (``spec.ceiling``: every draft
    accepted, at the drafter's measured cost) loses to edge-only: the acceptance a round would measure
    cannot make them pay, and the device's first session at a new temperature spent 0.9 s of 3.2 on
    such rounds (a drafter at the target's cost per token); they are priced as any other, their
    optimism capped by that best case (UCB's bonus stands for what the arm might deliver, which is
    bounded) and its rounds counted as it runs them (``fresh_rounds``): uncapped, over
    ``probe_rounds``, the first such exploration at T = 1 was priced at 0.22 s where it lost 1.2 s
    (a drafter at 1.5x the target's cost). Edge-only's price is measured from its first round on (the
    interval its tokens streamed at), so it keeps its priced rate. Drafting that the model now predicts
    faster than edge-only (:func:`claims`) is priced at the least, ``margin`` of its time, unless its
    last explorations were measured to lose (then at what they cost, as any)."""
    if r_edge <= 0 or r_spec <= 0 or (arm == SPEC and not state.measured(SPEC) and could_pay(spec, r_edge, cfg)):
        return 0.0
    sw_tokens, sw_s = state.switch.per_round() or (spec.tokens, 2 * spec.tokens / r_spec)
    switch_excess = max(0.0, sw_s - sw_tokens / r_spec)   # a catch-up round beyond a steady one
    # priced optimistically (UCB1, Auer, Cesa-Bianchi & Fischer 2002: the less an arm was measured,
    # the larger its bonus), so that an arm the model or a few rounds wrongly thought poor is retried
    bonus = 1 + cfg.optimism / math.sqrt(state.sums(arm).rounds + cfg.prior_rounds)
    if arm == SPEC:  # the bonus lifts the rate up to the arm's best case, not past it (nor below its rounds')
        r_spec = max(r_spec, min(r_spec * bonus, spec.ceiling))
        measuring = probe_rounds(state, cfg, SPEC) - 1   # the rounds after its catch-up, as it will run them
        tokens = sw_tokens + measuring * spec.tokens
        probe_s = sw_s + measuring * spec.tokens / r_spec
        loss = probe_s - tokens / r_edge + state.edge_wait.mean()   # edge-only again waits its first token
        if cfg.model_claims and claims(spec, r_edge, cfg):
            loss = min(loss, 0.0)   # it is expected to win: its switches are paid once, then made up
    else:
        r_edge *= bonus
        probe_s = edge.tokens / r_edge
        loss = probe_s - edge.tokens / r_spec + switch_excess + state.edge_wait.mean()
    if cfg.priced_by_cost and state.probe_cost(arm).count > 0:
        loss = max(loss, state.probe_cost(arm).mean())
    share = cfg.explore_cost / (1 + backoff(state, cfg, arm, spec if arm == SPEC else edge))
    return max(loss, cfg.margin * probe_s) / max(1e-6, share)


def claims(spec: ArmPrior, r_edge: float, cfg: NetConfig) -> bool:
    """Whether the model predicts drafted rounds faster than edge-only's ``r_edge`` by ``margin`` (within
    their best case). The drafted arm's rounds are of other texts and settings (a session's sums start
    from the device's, and a round of one draft length says little about another), while the model's
    prediction holds this text's acceptance as measured while it streams (the shadow, at T = 0) or as
    its own rounds left it: where the two disagree, an exploration is how the net learns which is right.
    Priced as a loss there, it kept drafting unexplored for 25-75 s where the model predicted 18.3
    tok/s against edge-only's 12.6 and the arm's rounds, from the 8-token warm-up session before (its
    rounds drafted 1-3 tokens where it was logged), 11.0 (held-out nyumets-lirr at T = 0: two 96-token
    sessions ran edge-only at 0.63x and 0.98x the best fixed setting, where drafting ran at 1.33x
    edge-only). The model can be wrong the other way: an exploration that loses is priced
    (``priced_by_cost``), so a model that keeps claiming costs ``explore_cost`` of the time, as any arm
    explored."""
    return min(spec.rate, spec.ceiling) > (1 + cfg.margin) * r_edge


def could_pay(spec: ArmPrior, r_edge: float, cfg: NetConfig) -> bool:
    """Whether drafted rounds could beat edge-only's ``r_edge`` by ``margin`` at their best case."""
    return spec.ceiling > (1 + cfg.margin) * r_edge


def backoff(state: NetState, cfg: NetConfig, arm: str, prior: ArmPrior) -> int:
    """How many times ``arm``'s explorations lost in a row (at most ``backoff``), 0 while the model
    predicts ``arm`` faster than its rounds delivered, by more than ``margin`` (what the model learned
    since, a drafter's acceptance rising in the explorations themselves, is news the next exploration
    should test soon). While ``arm``'s rounds delivered more than the other arm's
    (:func:`_measured_better`), its first ``forgive`` losses do not count: UCB thins out the
    explorations of an arm measured worse; one measured better is left only because the model
    disagrees (a T = 1 text whose drafts were rejected early twice, after drafted rounds ran at 15
    tok/s against edge-only's 12), and its explorations are what bring it back. Not a whole streak:
    the steady rounds may be old (they forget only as the arm runs), and explorations that keep losing
    are newer news; a drafter that slowed kept its faster steady rounds for good, and was explored at
    the full share (~3 % of the held-out sessions' time at 1.5x the target's cost per token)."""
    measured = state.sums(arm)
    if measured.seconds <= 0:
        return 0
    # by more than ``margin``: a model calibrated on the same rounds (autotune's time scale) predicts
    # the arm within a hair of them either way, and the backoff flapped on and off with that hair
    if prior.rate > (1 + cfg.margin) * measured.tokens / measured.seconds:
        return 0
    lost = state.lost(arm)
    if _measured_better(state, cfg, arm):
        lost = max(0, lost - cfg.forgive)
    return min(lost, cfg.backoff)


def _measured_better(state: NetState, cfg: NetConfig, arm: str) -> bool:
    """Whether ``arm``'s rounds delivered more than the other arm's (drafting by ``margin``). Drafting
    is judged by its steady rounds: an exploration's measuring round was drafted while its catch-up
    was verified, so it flatters a slow drafter (at 1.5x the target's cost per token: 15-16 tok/s
    after a catch-up, 11 in steady rounds, where edge-only made 13.5-14), and on those alone a
    drafter that never pays was explored at the full share every few seconds."""
    mine = state.spec_steady if arm == SPEC else state.edge
    rival = state.sums(EDGE if arm == SPEC else SPEC)
    if mine.seconds <= 0 or rival.seconds <= 0:
        return False
    lead = 1 + cfg.margin if arm == SPEC else 1.0
    return mine.tokens / mine.seconds > lead * rival.tokens / rival.seconds


def with_discount(cfg: NetConfig, memory: float) -> NetConfig:
    """``cfg`` with its discount scaled by auto's ``memory`` (0: every estimate its latest round)."""
    return replace(cfg, discount=cfg.discount * memory)
