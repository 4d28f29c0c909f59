"""Mode auto's fit of the link: round trip, uplink and downlink goodput, stalls and changes, from each
round's network time (device wall time minus the edge's reported queue, decode and verify time)
against its bytes. Pure: no clock, no lock (the tracker that owns one holds its lock).

Round trip and uplink goodput are fitted jointly over the last few rounds (newest weighted most;
:func:`~specdec.device.autotune.fit_link`): a round's time cannot say by itself how much of it was
propagation and how much serialization, rounds of different sizes can. The intercept is the round
trip (its mean, jitter and loss included: what a round expects to pay), the slope the inverse
goodput; downlink goodput comes from DSSD's full-p_j replies.

A round trip above the link's usual one (the median of its recent fits) relaxes back toward it for
the seconds no round measures it (:meth:`LinkFit.elapse`), as a mean-reverting process's forecast
does. Rounds measure it only while they draft, or wait for an edge-only round's first token: a round
trip inflated by a bad spell would keep auto edge-only, whose rounds sent ahead never measure it, and
a device that knows it as it was seconds ago priced drafting at the spell's round trip (0.39 s on a
40 ms link) for a whole session. A round trip below the usual one is not pulled up: drafted rounds
measure it every round, so a fit that is too low corrects itself.
"""
from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

from specdec.device import autotune as A
from specdec.device import tracker_state as TS
from specdec.device.tracker_state import FAST_LINK_BPS


@dataclass(frozen=True)
class LinkConfig:
    """The fit's constants. They are about links (segment sizes, timer and outage scales of cellular
    links), not about the device or the edge: docs/modes.md, "Why mode auto's constants are what
    they are"."""
    # Before any measurement: a middling link, so the first rounds carry tens of KB at most (a round
    # sized for 1 Gbit/s takes seconds on a slow link).
    prior_uplink_bps: float = 10e6
    trust_memory: int = 32           # rounds whose sizes say how large a round the goodput estimate covers
    # The goodput estimate may rise this much per round and fall without limit: one noisy window
    # must not send dense rounds down a slow link (each would take seconds).
    rate_growth: float = 4.0
    min_rate_sample_bytes: int = 1200  # rounds smaller than about one segment say nothing about goodput
    min_excess_s: float = 2e-4       # below this the serialization is lost in timer noise
    window: int = 6                  # rounds in the round-trip / goodput fit ...
    decay: float = 0.7               # ... newest weighted most
    change_rel: float = 0.5          # a round this far off the fit (relative ...
    change_abs_s: float = 0.01       # ... and absolute) is an outlier
    # ... and this far beyond it a stall: an outage met in flight (recorded cellular links stop for
    # hundreds of ms; a lost segment's timeout, 0.2 s, stays a cost rounds expect to pay)
    stall_rel: float = 2.0
    stall_abs_s: float = 0.3
    rate_window: int = 6             # downlink goodput samples (DSSD's full p_j replies)
    # Rounds without a goodput sample before a large round re-measures it, or this many after the
    # link changed (a stale goodput keeps small rounds on a fast link until a large round measures it).
    probe_every: int = 12
    probe_after_change: int = 2
    # The link's usual round trip: the median of this many recent fits (a bad spell's few rounds do not
    # move it; a link that stays slower does, in half as many rounds) ...
    usual_window: int = 16
    # ... to which a higher fit relaxes with this time constant while no round measures it: the
    # scale of a bad spell on recorded cellular links (outages and queues last hundreds of ms to
    # seconds).
    rtt_relax_s: float = 1.0


def goodput(samples) -> float:
    """Bits per second of ``(bits, seconds)`` samples (FAST_LINK_BPS without any)."""
    bits, secs = sum(b for b, _ in samples), sum(s for _, s in samples)
    return bits / secs if samples and secs > 0 else FAST_LINK_BPS


class LinkFit:
    """The link as the device's rounds measured it."""

    def __init__(self, config: LinkConfig = LinkConfig(), memory: float = 1.0):
        self.config = config
        self.memory = memory  # AutoConfig.memory: 0 makes the fit the latest round's alone (tests)
        self.samples = collections.deque(maxlen=config.window)      # (uplink bits, network s) per round
        self.sizes_sent = collections.deque(maxlen=config.trust_memory)  # uplink bits of recent rounds
        self.fit = (0.0, config.prior_uplink_bps)                    # (round trip s, uplink bits/s)
        self.down = collections.deque(maxlen=config.rate_window)     # (downlink bits, seconds)
        self._last_off = 0.0                                         # the last round's miss, if an outlier
        self._held: tuple[float, float] | None = None                # the last round, if it stalled
        self.stalls = 0                                              # rounds held out as stalled
        self.rounds_since_rate = 0                                   # rounds since a goodput sample
        self.fitted_rtts = collections.deque(maxlen=config.usual_window)  # the round trip of each fit
        self.unmeasured_s = 0.0                                      # seconds since a round measured it
        self.measured = False                                        # the fit rests on a round (or a remembered link)

    def rtt_s(self) -> float:
        """The round trip a round expects now: the fit's, relaxed toward the usual one for the seconds
        no round has measured the link."""
        rtt = self.fit[0]
        if self.unmeasured_s <= 0:  # (every drafted round: no median to take)
            return rtt
        usual = self.usual_rtt_s()
        if rtt <= usual:
            return rtt
        return usual + (rtt - usual) * math.exp(-self.unmeasured_s / self.config.rtt_relax_s)

    def usual_rtt_s(self) -> float:
        """The median of the recent fits' round trips (the fit's own before any)."""
        return statistics.median(self.fitted_rtts) if self.fitted_rtts else self.fit[0]

    def elapse(self, seconds: float) -> None:
        """``seconds`` of rounds passed that did not measure the link (after the last one that did).
        Sessions running at once each add their rounds' seconds, so the link relaxes up to that many
        times faster while all of them stream edge-only; the first drafted round measures it again."""
        self.unmeasured_s += max(0.0, seconds)

    def uplink_bps(self) -> float:
        return self.fit[1]

    def downlink_bps(self) -> float | None:
        return goodput(self.down) if self.down else None

    def measured_up_bits(self) -> float:
        """The largest recent round: how large a round the goodput estimate covers."""
        return max(self.sizes_sent, default=8.0 * self.config.min_rate_sample_bytes)

    def probe_due(self) -> bool:
        """Whether the goodput has gone unmeasured long enough that a large round should measure it."""
        return self.rounds_since_rate >= self.config.probe_every

    def add(self, network: float, up_bytes: int, down_bytes: int, residual_trips: int = 0) -> bool:
        """One round's network time; True if the round stalled (held out of the fit)."""
        c = self.config
        self.unmeasured_s = 0.0  # (judged against the fit itself: the relaxed value is a forecast)
        if residual_trips:  # a DSSD fallback's round trips and p_j (head or whole) down: a downlink sample
            excess = network - (1 + residual_trips) * self.fit[0] - 8 * up_bytes / self.uplink_bps()
            self.down.append((8 * down_bytes, max(c.min_excess_s, excess)))
            return False
        bits = 8.0 * up_bytes
        stalled = self._stalled(bits, network)
        changed = self._check_change(bits, network)
        self.sizes_sent.append(bits)
        if stalled and not changed:
            # Far slower than the link has been: it met an outage in flight. Held out of the fit (one
            # such round would hold the round trip up, or the goodput down, for the next rounds);
            # the next round says whether the link itself got slower (_check_change takes both).
            self._held = (bits, network)
            self.stalls += 1
            return True
        self._held = None
        self.samples.append((bits, network))
        n = len(self.samples)
        weights = [(c.decay * self.memory) ** (n - 1 - i) for i in range(n)]
        rtt, rate = A.fit_link(list(self.samples), weights, self.fit[0], self.uplink_bps(),
                               8.0 * c.min_rate_sample_bytes)
        if rtt > 0:  # (a fit that could not part the round trip from serialization holds 0 or its prior)
            self.fitted_rtts.append(rtt)
        self.rounds_since_rate = 0 if up_bytes >= c.min_rate_sample_bytes else self.rounds_since_rate + 1
        if changed:  # small rounds cannot tell a new round trip from a new goodput: probe soon
            self.rounds_since_rate = max(self.rounds_since_rate, c.probe_every - c.probe_after_change)
        self.fit = (rtt, min(rate, self.uplink_bps() * c.rate_growth, FAST_LINK_BPS))
        self.measured = True
        return False

    def _stalled(self, bits: float, network: float) -> bool:
        """Whether a round took ``stall_rel`` times its expected network time beyond it, and ``stall_abs_s``."""
        expected = self.fit[0] + bits / self.uplink_bps()
        c = self.config
        return len(self.samples) >= 2 and network - expected > max(c.stall_rel * expected, c.stall_abs_s)

    def _check_change(self, bits: float, network: float) -> bool:
        """Two rounds in a row far from what the fit predicts (in the same direction), or one far faster:
        the link changed, so the rounds before them describe another link; a single slow one (a lost
        segment) does not."""
        c, rtt = self.config, self.fit[0]
        expected = rtt + bits / self.uplink_bps()
        off = network - expected
        outlier = abs(off) > max(c.change_rel * expected, c.change_abs_s) and len(self.samples) >= 2
        same_way = outlier and self._last_off * off > 0
        # Loss and queues only slow a round down, and no round beats the round trip: one far faster than
        # the round-trip estimate alone is a faster link, at once (token-bucket bursts can beat the
        # goodput fit, not the round trip; waiting for a second round would run it with settings
        # chosen for the old, slower link).
        faster = bool(self.samples) and network < rtt - max(c.change_rel * rtt, c.change_abs_s)
        self._last_off = off if outlier else 0.0
        if same_way or faster:
            last = [self._held or self.samples[-1]] if same_way else []
            self.samples.clear()
            self.samples.extend(last)
            self.down.clear()  # downlink goodput measured on the link before
        return same_way or faster

    def restore(self, s: TS.LinkState) -> None:
        """Start from a remembered link (device/tracker_state.py)."""
        self.fit = (s.rtt_s, s.uplink_bps)
        self.measured = True
        if s.measured_up_bits:
            self.sizes_sent.append(s.measured_up_bits)
        if s.downlink_bps is not None:
            self.down.append((s.downlink_bps, 1.0))
