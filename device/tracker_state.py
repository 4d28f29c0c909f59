"""What mode auto remembers across processes, as a record: :class:`TrackerState`, written and read by
one function pair (:func:`to_json`, :func:`from_json`). The tracker takes it (``LinkTracker.snapshot``)
and starts from it (``LinkTracker.restore``); device/edge_memory.py keeps it on disk.

Two parts with their own lifetimes: ``link`` (the link and the edge: round trip, goodput, the edge's
forward times, learned time scales) describes where the device was; ``models`` (the drafter with this
edge's target: per temperature acceptance and codec estimates, the drafter's own speed) outlives it.
Every number read back is checked (finite, within its range): a malformed memory raises ValueError
and changes nothing. Pure: no I/O.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field, fields
from typing import Mapping

from specdec.common.modes import Mode
from specdec.device import safety_net as N

FAST_LINK_BPS = 1e9      # the most goodput the device believes in (and what a probe asks about)
TIME_SCALE_MIN, TIME_SCALE_MAX = 0.5, 4.0  # bounds of the learned measured/modelled round-time ratio
MAX_SECONDS = 60.0       # no remembered time (round trip, forward, drafting) is longer
MAX_BYTES = 1e9          # sizes and acceptance counts
MAX_COUNT = 1e12         # the count of encoded q's and the largest round's bits
Key = tuple[Mode, int]   # a codec key: (mode, K)
Ratio = tuple[float, float]  # (hits, trials)


@dataclass(frozen=True)
class LinkState:
    rtt_s: float
    uplink_bps: float
    measured_up_bits: float = 0.0              # the largest round the goodput was measured with
    downlink_bps: float | None = None
    verify: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of the edge's forwards
    queue_s: float | None = None
    decode_s: Mapping[Mode, float] = field(default_factory=dict)
    edge_token_s: float | None = None           # edge-only rounds' measured seconds per streamed token
    time_scale: Mapping[Key, float] = field(default_factory=dict)  # measured / modelled round time
    nets: Mapping[float, N.NetState] = field(default_factory=dict)  # per temperature: the safety net's sums


@dataclass(frozen=True)
class SideState:
    """The estimates of one temperature (auto.py's ``_ModelSide``)."""
    long: Ratio
    guess: Ratio
    fallback: Ratio
    long_gumbel: Ratio = (0.0, 0.0)            # absent from memories of before gumbel
    sigma: Mapping[Key, float] = field(default_factory=dict)
    packet_bytes: Mapping[Key, float] = field(default_factory=dict)
    encoded: int = 0


@dataclass(frozen=True)
class ModelsState:
    draft_s: float | None = None
    fallback_bytes: float | None = None
    encode_s: Mapping[Mode, float] = field(default_factory=dict)
    temperatures: Mapping[float, SideState] = field(default_factory=dict)


@dataclass(frozen=True)
class TrackerState:
    link: LinkState | None = None
    models: ModelsState | None = None


def to_json(state: TrackerState) -> dict:
    """``{"link": ..., "models": ...}`` as plain JSON (a part left out is None)."""
    return {"link": None if state.link is None else _link_json(state.link),
            "models": None if state.models is None else _models_json(state.models)}


def from_json(d: Mapping) -> TrackerState:
    """The record ``to_json`` wrote (either part may be None); ValueError if any field is malformed."""
    try:
        link = None if d.get("link") is None else _link_of(d["link"])
        models = None if d.get("models") is None else _models_of(d["models"])
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed remembered state: {exc!r}") from None
    return TrackerState(link, models)


def _link_json(s: LinkState) -> dict:
    return {"rtt_s": s.rtt_s, "uplink_bps": s.uplink_bps, "measured_up_bits": s.measured_up_bits,
            "downlink_bps": s.downlink_bps, "verify": [list(x) for x in s.verify], "queue_s": s.queue_s,
            "edge_token_s": s.edge_token_s,
            "decode_s": {m.value: v for m, v in s.decode_s.items()}, "time_scale": _keyed_json(s.time_scale),
            "nets": {repr(t): _net_json(net) for t, net in s.nets.items()}}


def _link_of(d: Mapping) -> LinkState:
    return LinkState(
        rtt_s=num(d["rtt_s"], 0.0, MAX_SECONDS), uplink_bps=num(d["uplink_bps"], 1.0, FAST_LINK_BPS),
        measured_up_bits=num(d.get("measured_up_bits", 0.0), 0.0, MAX_COUNT),
        downlink_bps=_optional(d.get("downlink_bps"), 1.0, FAST_LINK_BPS),
        verify=tuple((int(num(n, 1, 1e6)), num(x, 0.0, MAX_SECONDS)) for n, x in d.get("verify", [])),
        queue_s=_optional(d.get("queue_s"), 0.0, MAX_SECONDS),
        edge_token_s=_optional(d.get("edge_token_s"), 0.0, MAX_SECONDS),
        decode_s={Mode(m): num(v, 0.0, MAX_SECONDS) for m, v in d.get("decode_s", {}).items()},
        time_scale={key_of(k): num(v, TIME_SCALE_MIN, TIME_SCALE_MAX) for k, v in d.get("time_scale", {}).items()},
        nets={num(float(t), 0.0, 1e3): _net_of(net) for t, net in d.get("nets", {}).items()})


def _net_json(net: N.NetState) -> dict:
    """The net's measurements (safety_net.remembered: the run under way is a session's, not kept)."""
    return {**{name: list(astuple(getattr(net, name))) for name in (*N.SUMS, *N.COSTS)},
            **{name: getattr(net, name) for name in N.LOST.values()}}


def _net_of(d: Mapping) -> N.NetState:
    sums = {arm: N.Sums(*(num(x, 0.0, MAX_COUNT) for x in _fields(d[arm], len(fields(N.Sums)))))
            for arm in N.SUMS if arm in d or arm != "spec_steady"}  # spec_steady: absent in older files
    costs = {name: N.Cost(*(num(x, 0.0, MAX_COUNT) for x in _fields(d[name], len(fields(N.Cost)))))
             for name in N.COSTS}
    lost = {name: int(num(d.get(name, 0), 0, MAX_COUNT)) for name in N.LOST.values()}  # absent in older files
    return N.NetState(**sums, **costs, **lost)


def _fields(values, n: int) -> list:
    if len(values) != n:
        raise ValueError(f"{len(values)} values where {n} are kept")
    return list(values)


def _models_json(s: ModelsState) -> dict:
    temps = {repr(t): {"long": list(side.long), "sigma": _keyed_json(side.sigma),
                       "packet_bytes": _keyed_json(side.packet_bytes), "encoded": side.encoded,
                       "guess": list(side.guess), "fallback": list(side.fallback),
                       "long_gumbel": list(side.long_gumbel)} for t, side in s.temperatures.items()}
    return {"draft_s": s.draft_s, "fallback_bytes": s.fallback_bytes,
            "encode_s": {m.value: v for m, v in s.encode_s.items()}, "temperatures": temps}


def _models_of(d: Mapping) -> ModelsState:
    temps = {num(float(t), 0.0, 1e3): SideState(
        long=_ratio(m["long"]), guess=_ratio(m["guess"]), fallback=_ratio(m["fallback"]),
        long_gumbel=_ratio(m.get("long_gumbel", (0.0, 0.0))),
        sigma={key_of(k): num(v, 0.0, 1.0) for k, v in m.get("sigma", {}).items()},
        packet_bytes={key_of(k): num(v, 0.0, MAX_BYTES) for k, v in m.get("packet_bytes", {}).items()},
        encoded=int(num(m.get("encoded", 0), 0, MAX_COUNT))) for t, m in d.get("temperatures", {}).items()}
    return ModelsState(draft_s=_optional(d.get("draft_s"), 0.0, MAX_SECONDS),
                       fallback_bytes=_optional(d.get("fallback_bytes"), 0.0, MAX_BYTES),
                       encode_s={Mode(m): num(v, 0.0, MAX_SECONDS) for m, v in d.get("encode_s", {}).items()},
                       temperatures=temps)


def _keyed_json(values: Mapping[Key, float]) -> dict:
    return {f"{k[0].value}:{k[1]}": v for k, v in values.items()}


def key_of(text: str) -> Key:
    mode, _, k = str(text).partition(":")
    return Mode(mode), int(k)


def _ratio(pair) -> Ratio:
    return num(pair[0], 0.0, MAX_BYTES), num(pair[1], 0.0, MAX_BYTES)


def _optional(x, lo: float, hi: float) -> float | None:
    return None if x is None else num(x, lo, hi)


def num(x, lo: float, hi: float) -> float:
    """A remembered number, checked: ValueError unless finite and within [lo, hi]."""
    v = float(x)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"remembered value {x!r} outside [{lo}, {hi}]")
    return v
