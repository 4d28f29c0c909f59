"""tc-style quantities for command lines: rates (``1mbit``) and times (``20ms``) to base units."""
from __future__ import annotations

import re

# tc(8) units: rates in bits per second (kbit = 1000 bit/s, as tc counts them), times in seconds.
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8.0, "kbps": 8e3, "mbps": 8e6}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


def _parse(text: str, units: dict[str, float], default: str, what: str) -> float:
    m = _QUANTITY.match(text.lower())
    if not m or (m.group(2) or default) not in units:
        raise ValueError(f"not a {what}: {text!r} (units: {', '.join(units)})")
    return float(m.group(1)) * units[m.group(2) or default]


def parse_rate(text: str) -> float:
    """``'1mbit'`` -> 1e6 bit/s; a bare number is bit/s (tc: ``bps`` means bytes per second)."""
    return _parse(text, _RATE_UNITS, "bit", "rate")


def parse_time(text: str) -> float:
    """``'20ms'`` -> 0.02 s; a bare number is seconds."""
    return _parse(text, _TIME_UNITS, "s", "time")


def parse_percent(text: str) -> float:
    """``'1%'`` or ``'0.01'`` -> 0.01."""
    t = text.strip()
    value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"loss must be in [0, 100%), got {text!r}")
    return value


def tc_rate(bps: float) -> str:
    return f"{int(round(bps))}bit"


def tc_time(seconds: float) -> str:
    return f"{int(round(seconds * 1e6))}us"


def argtype(parse):
    """An argparse ``type=`` from a parser that raises ValueError: bad values become one-line errors."""
    import argparse

    def wrapped(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return wrapped


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


_QUEUE_UNITS = {"b": (1, 0), "kb": (1000, 0), "kib": (1024, 0), "mb": (1000 ** 2, 0), "pkt": (0, 1),
                "packets": (0, 1), "p": (0, 1)}


def parse_queue(text: str) -> tuple[float, float]:
    """A drop-tail queue limit: ``'150kb'`` -> (150000 bytes, 0), ``'100pkt'`` -> (0, 100 packets);
    ``'0'`` -> no limit."""
    m = _QUANTITY.match(text.lower())
    if not m or (m.group(2) or "b") not in _QUEUE_UNITS:
        raise ValueError(f"not a queue limit: {text!r} (e.g. 150kb, 64kib, 100pkt)")
    per_byte, per_packet = _QUEUE_UNITS[m.group(2) or "b"]
    n = float(m.group(1))
    if per_packet and n != int(n):
        raise ValueError(f"a queue limit in packets is a whole number, got {text!r}")
    return n * per_byte, n * per_packet
