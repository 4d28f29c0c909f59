"""C-SQS threshold controller: online conformal update with checkpoint and backtrack.

Reference: SQS, Bhattacharjee et al., "Conformal Sparsification for Bandwidth-Efficient Edge-Cloud
Speculative Decoding": §3, eq. (6) (support ``{x : q(x) >= beta}``), eq. (8) (update
``beta <- beta - eta (dropped - alpha)``), Alg. 1 (checkpoint/backtrack per batch), Theorem 2 and
appendix A.3, Lemma 2 (average dropped mass over accepted tokens tends to alpha).

The sign of eq. (8) works because a larger threshold keeps fewer tokens: when the dropped mass
exceeds alpha the threshold goes down (more tokens kept), otherwise it creeps up.

Reading of Alg. 1 implemented here (lines 8 and 11-13): during a round the device applies eq. (8)
after every drafted position, so position n+1 is drafted with the threshold that already saw
positions 1..n. When the verdict arrives with T accepted positions, the threshold returns to its
value after the T accepted positions' updates ("the value of the last accepted token"); if a
drafted position was rejected (T < L), one more update is applied with that position's dropped
mass ("a further iteration is done for the new, (T+1)-th token"): its draft distribution was
computed on an accepted prefix, so it belongs to the stream the guarantee is about. If all L
were accepted, the bonus token was not drafted and nothing more is applied. Updates for
positions after the first rejection are discarded: their contexts never happened.

Guarantee (exact telescoping, SQS Lemma 2): over the T updates that survive,
``sum_t (dropped_t - alpha) = (beta_0 - beta_T) / eta``. Since a threshold <= 0 keeps every
token (dropped = 0), beta never falls below ``-eta (1 - alpha)`` (SQS Lemma 3-4), so the average
dropped mass is at most ``alpha + (beta_0 + eta (1 - alpha)) / (eta T)``, which is within the
paper's eq. (9) bound ``alpha + (|beta_0| + 1 + eta alpha) / (eta T)`` for eta <= 1. (Lemma 4's
upper bound on beta does not hold for peaked distributions -- dropping all but the argmax drops
``1 - max q``, not 1 -- but only the lower bound is needed for the average.)
"""
from __future__ import annotations

from specdec.common.modes import Mode
from specdec.common.settings import DraftSettings

from specdec.common.validation import check_int, check_positive, check_real, check_unit_interval


def conformal_update(beta: float, dropped: float, alpha: float, eta: float) -> float:
    """One step of SQS eq. (8): ``beta - eta (dropped - alpha)``."""
    return beta - eta * (dropped - alpha)


class ConformalController:
    """Threshold state for C-SQS (SQS Alg. 1). No randomness, no clock: state is explicit.

    Usage per round: ``start_round()``; for each drafted position use ``beta`` for the support,
    then ``observe(dropped_mass)``; on the verdict ``on_verdict(num_accepted)``.
    """

    def __init__(self, alpha: float, eta: float, beta0: float):
        # target average dropped mass
        self.alpha = check_unit_interval(alpha, "alpha", low_open=True, high_open=True)
        self.eta = check_positive(eta, "eta")  # learning rate of eq. (8)
        self.beta = check_real(beta0, "beta0")  # threshold for the next drafted position
        self.checkpoint: float | None = None  # beta at the start of the open round, None if none
        self.round_dropped: list[float] = []  # dropped mass of each position drafted this round

    def start_round(self) -> None:
        """Checkpoint the threshold before drafting a round (Alg. 1 line 3)."""
        self.checkpoint = self.beta
        self.round_dropped = []

    def abort_round(self) -> None:
        """Forget the open round (its verdict never came, e.g. the stream broke): back to the checkpoint."""
        if self.checkpoint is not None:
            self.beta = self.checkpoint
        self.checkpoint, self.round_dropped = None, []

    def observe(self, dropped_mass: float) -> float:
        """Apply eq. (8) for one drafted position (Alg. 1 line 8); returns the new beta.

        Outside a round (no start_round) the update is applied to a plain stream.
        """
        dropped_mass = check_unit_interval(dropped_mass, "dropped_mass")
        self.beta = conformal_update(self.beta, dropped_mass, self.alpha, self.eta)
        if self.checkpoint is not None:
            self.round_dropped.append(dropped_mass)
        return self.beta

    def on_verdict(self, num_accepted: int) -> float:
        """Backtrack to the accepted prefix and update once for the rejected position (Alg. 1
        lines 11-13, see module docstring); closes the round and returns the new beta."""
        if self.checkpoint is None:
            raise ValueError("on_verdict without start_round")
        drafted = len(self.round_dropped)
        check_int(num_accepted, "num_accepted", 0, drafted)
        survivors = num_accepted + 1 if num_accepted < drafted else drafted
        beta = self.checkpoint
        for dropped in self.round_dropped[:survivors]:
            beta = conformal_update(beta, dropped, self.alpha, self.eta)
        self.beta, self.checkpoint, self.round_dropped = beta, None, []
        return beta


class SessionThreshold:
    """A session's C-SQS across its rounds, in one place: which rounds read the threshold (C-SQS
    ones), when a new controller starts (new C-SQS parameters; the same ones keep their threshold
    across rounds of other modes) and the per-round calls of :class:`ConformalController`. Every
    method is a no-op for a round of another mode."""

    def __init__(self) -> None:
        self.controller: ConformalController | None = None
        self._key: tuple[float, float, float] | None = None

    def _ours(self, settings: DraftSettings) -> bool:
        return settings.mode is Mode.CSQS and self.controller is not None

    def start_round(self, settings: DraftSettings) -> None:
        """Before a round is drafted: its controller (new parameters: a new one), checkpointed."""
        if settings.mode is not Mode.CSQS:
            return
        key = (settings.csqs_alpha, settings.csqs_eta, settings.csqs_beta0)
        if key != self._key:
            self.controller, self._key = ConformalController(*key), key
        self.controller.start_round()  # one threshold per round (trees: updated along the path later)

    def threshold(self, settings: DraftSettings) -> float | None:
        """beta for the next drafted position of a round with ``settings``; None outside C-SQS."""
        return self.controller.beta if self._ours(settings) else None

    def observe(self, settings: DraftSettings, dropped_mass: float) -> None:
        if self._ours(settings):
            self.controller.observe(dropped_mass)

    def on_verdict(self, settings: DraftSettings, num_accepted: int) -> None:
        if self._ours(settings):
            self.controller.on_verdict(num_accepted)

    def on_path(self, settings: DraftSettings, dropped: list[float], nodes: list[int]) -> None:
        """A tree's verdict: one update per internal node on the kept path (``dropped``: each
        internal node's dropped mass), then the verdict for as many positions."""
        if self._ours(settings):
            for node in nodes:
                self.controller.observe(dropped[node])
            self.controller.on_verdict(len(nodes))

    def abort_round(self) -> None:
        """The round in flight never got its verdict: back to its checkpoint."""
        if self.controller is not None:
            self.controller.abort_round()
