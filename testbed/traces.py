"""Recorded link capacity in Mahimahi's trace format: reading a trace, and what it lets through.

A trace (Winstein et al., NSDI 2013, as shipped with the Mahimahi emulator; ``../shared/traces``)
is one line per delivery opportunity: a timestamp in milliseconds at which one packet of up to
:data:`PACKET_BYTES` may cross the bottleneck (several in one millisecond repeat the timestamp).
It repeats when it reaches its end, shifted by its last timestamp (Mahimahi's ``link_queue.cc``),
so opportunity ``g`` of the endless schedule falls at ``(g // n) * period + times[g % n]``.

Pure: no clock, no socket. :class:`~specdec.testbed.linkemu.LinkClock` serves a byte stream from
these opportunities; the benchmarks plot :meth:`Trace.capacity_series` under their tokens/s.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

PACKET_BYTES = 1500   # what one delivery opportunity carries: one MTU-sized packet (Mahimahi)


@dataclass(frozen=True)
class Trace:
    """A delivery schedule: opportunity times in ms (non-decreasing), repeated every ``period_ms``."""
    name: str
    times_ms: tuple[int, ...]
    period_ms: int

    @classmethod
    def parse(cls, text: str, name: str = "trace") -> "Trace":
        """A trace from its text; ValueError on anything that is not one (empty, negative, unordered)."""
        times = []
        for i, line in enumerate(text.split("\n"), 1):
            line = line.strip()
            if not line:
                continue
            if not line.isdigit():
                raise ValueError(f"{name}: line {i}: expected a millisecond count, got {line[:40]!r}")
            t = int(line)
            if times and t < times[-1]:
                raise ValueError(f"{name}: line {i}: {t} ms comes after {times[-1]} ms")
            times.append(t)
        if not times or times[-1] <= 0:
            raise ValueError(f"{name}: a trace needs at least one delivery opportunity after 0 ms")
        return cls(name, tuple(times), times[-1])

    @property
    def opportunities(self) -> int:
        return len(self.times_ms)

    @property
    def mean_bps(self) -> float:
        """Mean capacity over one period, in bits per second."""
        return self.opportunities * PACKET_BYTES * 8 / (self.period_ms / 1e3)

    def opportunity_ms(self, g: int) -> int:
        """When opportunity ``g`` of the endless (repeated) schedule comes, in ms from the trace's start."""
        cycle, i = divmod(g, len(self.times_ms))
        return cycle * self.period_ms + self.times_ms[i]

    def first_at_or_after(self, ms: float) -> int:
        """Index of the first opportunity at or after ``ms`` (the schedule starts at 0)."""
        n = len(self.times_ms)
        cycle = math.floor(max(0.0, ms) / self.period_ms)
        rest = max(0.0, ms) - cycle * self.period_ms
        # the cycle before ends at this one's start (its last opportunity is at the period): those count
        i = bisect.bisect_left(self.times_ms, rest + self.period_ms)
        if cycle > 0 and i < n:
            return (cycle - 1) * n + i
        return cycle * n + bisect.bisect_left(self.times_ms, rest)  # n: the next cycle's first, the same index

    def opportunities_between(self, start_ms: float, end_ms: float) -> int:
        """Opportunities in (start_ms, end_ms]: what has crossed by end_ms since start_ms."""
        after = lambda ms: self.first_at_or_after(math.floor(ms) + 1)  # noqa: E731  (times are whole ms)
        return max(0, after(end_ms) - after(start_ms))

    def capacity_series(self, start_s: float, duration_s: float, bin_s: float) -> list[float]:
        """Capacity in bits per second of each ``bin_s`` window from ``start_s`` (trace seconds)."""
        bins = max(1, round(duration_s / bin_s))
        out = []
        for k in range(bins):
            a = (start_s + k * bin_s) * 1e3
            out.append(self.opportunities_between(a, a + bin_s * 1e3) * PACKET_BYTES * 8 / bin_s)
        return out

    def outages(self, min_ms: float) -> list[tuple[float, float]]:
        """(start s, length s) of every gap of at least ``min_ms`` without an opportunity, over one period."""
        t = self.times_ms
        return [(a / 1e3, (b - a) / 1e3) for a, b in zip(t, t[1:]) if b - a >= min_ms]


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> Trace:
    return Trace.parse(Path(path).read_text(), Path(path).name)


def load_trace(path: str | os.PathLike) -> Trace:
    """The trace in ``path``, parsed once per version of the file; ValueError if unreadable or not a trace."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    return _load(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def trace_pairs(folder: str | os.PathLike) -> dict[str, tuple[Path, Path]]:
    """``{name: (uplink trace, downlink trace)}`` for every ``NAME.up`` with a ``NAME.down`` beside it
    in ``folder`` (Mahimahi's naming; ``.up`` = device to edge), sorted by name."""
    folder = Path(folder)
    out = {}
    for up in sorted(folder.glob("*.up")):
        down = up.with_suffix(".down")
        if down.is_file():
            out[up.stem] = (up, down)
    return out
