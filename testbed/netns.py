"""Two network namespaces joined by a veth pair, each direction shaped with ``tc`` (needs root).

::

    [ns <tag>-dev]  vd<tag> 198.18.0.2 ==== veth ==== ve<tag> 198.18.0.1  [ns <tag>-edge]
        uplink: egress qdisc of vd<tag>             downlink: egress qdisc of ve<tag>

Every direction is the egress of one veth end, so no ``ifb`` is needed here (the scripts in
``deploy/netem/`` shape one real interface both ways and need it for ingress).

Which shaper: :func:`netem_available` tries to attach ``netem`` to the device's veth end. Where the
kernel has it, each direction gets one ``netem`` qdisc with rate, delay, jitter and loss. Where it
does not (this project's kernels), ``tbf`` limits the rate in the kernel and delay, jitter and loss
come from :mod:`testbed.linkemu` running in the device namespace. :attr:`Testbed.shaper` says which.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
from dataclasses import dataclass

from specdec.testbed.linkemu import LinkSpec
from specdec.testbed.units import tc_rate, tc_time

EDGE_IP = "198.18.0.1"   # RFC 2544 benchmarking range; only ever inside the two namespaces
DEVICE_IP = "198.18.0.2"
PREFIX_LEN = 30
# tbf bucket: one full frame (1514 bytes on a 1500-byte MTU veth, as tc counts it) plus slack for
# tc's rounding of the bucket to timer ticks (a bucket smaller than a frame never sends it), or ~2 ms
# of the rate if more: a burst after an idle pause then costs the rate little, even for a
# request/response protocol that idles between rounds.
TBF_MIN_BURST_BYTES = 1600
TBF_BURST_SECONDS = 0.002
# tbf queue: 250 ms of the rate (at least 64 KiB) so a bulk TCP transfer is rate limited by
# queueing, not by drops and retransmissions.
TBF_QUEUE_SECONDS = 0.25
TBF_MIN_QUEUE_BYTES = 64 * 1024
NETEM_LIMIT_PACKETS = 10000   # netem's queue, in packets (its default of 1000 drops at high BDP)
CMD_TIMEOUT_S = 10.0


class ShapingError(RuntimeError):
    pass


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and r.returncode != 0:
        raise ShapingError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def in_ns(ns: str, *cmd: str) -> list[str]:
    """The command line that runs ``cmd`` inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *cmd]


# -- qdisc arguments (pure) -----------------------------------------------------------------------

def tbf_args(dev: str, spec: LinkSpec) -> list[str]:
    """``tc qdisc replace`` arguments for a rate-only token bucket on ``dev``."""
    rate_bytes = spec.rate_bps / 8
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes * TBF_BURST_SECONDS))
    limit = max(TBF_MIN_QUEUE_BYTES, int(rate_bytes * TBF_QUEUE_SECONDS))
    return ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", tc_rate(spec.rate_bps),
            "burst", str(burst), "limit", str(limit)]


def netem_args(dev: str, spec: LinkSpec) -> list[str]:
    """``tc qdisc replace`` arguments for netem with everything the spec asks for."""
    args = ["qdisc", "replace", "dev", dev, "root", "netem", "limit", str(NETEM_LIMIT_PACKETS)]
    if spec.delay_s or spec.jitter_s:
        args += ["delay", tc_time(spec.delay_s)]
        if spec.jitter_s:
            args += [tc_time(spec.jitter_s)]
    if spec.loss:
        args += ["loss", f"{spec.loss * 100:g}%"]
    if spec.rate_bps:
        args += ["rate", tc_rate(spec.rate_bps)]
    return args


def parse_sent_bytes(tc_stats: str) -> int:
    """Bytes the root qdisc sent, from ``tc -s qdisc show dev DEV``."""
    m = re.search(r"Sent (\d+) bytes", tc_stats)
    if not m:
        raise ShapingError(f"no 'Sent N bytes' in tc output: {tc_stats!r}")
    return int(m.group(1))


# -- namespaces ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    tag: str
    edge_ns: str
    device_ns: str
    edge_if: str
    device_if: str

    @classmethod
    def named(cls, tag: str) -> "Pair":
        # Interface names have at most 15 characters: a 2-letter prefix and a tag of <= 12.
        assert len(tag) <= 12 and tag.isalnum(), tag
        return cls(tag, f"sdtb-{tag}-edge", f"sdtb-{tag}-dev", f"ve{tag}", f"vd{tag}")


def create_pair(pair: Pair) -> None:
    _run("ip", "netns", "add", pair.edge_ns)
    _run("ip", "netns", "add", pair.device_ns)
    _run("ip", "link", "add", pair.edge_if, "netns", pair.edge_ns, "type", "veth",
         "peer", "name", pair.device_if, "netns", pair.device_ns)
    for ns, dev, ip in ((pair.edge_ns, pair.edge_if, EDGE_IP), (pair.device_ns, pair.device_if, DEVICE_IP)):
        _run("ip", "-n", ns, "addr", "add", f"{ip}/{PREFIX_LEN}", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")


def delete_pair(pair: Pair) -> None:
    """Remove both namespaces (which removes the veth pair with them); kill what runs inside."""
    for ns in (pair.edge_ns, pair.device_ns):
        _kill_namespace_processes(ns)
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", pair.edge_if, check=False)  # only there if creation failed midway


def _kill_namespace_processes(ns: str) -> None:
    """Processes left in a namespace this module created (ours: the testbed started them)."""
    r = _run("ip", "netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def namespaces() -> set[str]:
    return {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()}


# -- shaping -------------------------------------------------------------------------------------

def netem_available(ns: str, dev: str) -> bool:
    """Whether the kernel has netem: attach one to ``dev`` and take it off again."""
    r = _run(*in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "0ms"), check=False)
    if r.returncode != 0:
        return False
    _run(*in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root"), check=False)
    return True


def shape(ns: str, dev: str, spec: LinkSpec, use_netem: bool) -> None:
    """Shape the egress of ``dev``: netem with everything, or tbf with the rate only (if any)."""
    if use_netem and (spec.rate_bps or spec.delays):
        _run(*in_ns(ns, "tc", *netem_args(dev, spec)))
    elif spec.rate_bps:
        _run(*in_ns(ns, "tc", *tbf_args(dev, spec)))


def sent_bytes(ns: str, dev: str) -> int:
    return parse_sent_bytes(_run(*in_ns(ns, "tc", "-s", "qdisc", "show", "dev", dev)).stdout)


@dataclass(frozen=True)
class Testbed:
    pair: Pair
    uplink: LinkSpec
    downlink: LinkSpec
    shaper: str            # "netem", "tbf+linkemu", "tbf" or "none": what carries which property

    @property
    def needs_emulator(self) -> bool:
        """Delay, jitter or loss asked for and no netem to do it in the kernel."""
        return not self.shaper.startswith("netem") and (self.uplink.delays or self.downlink.delays)

    def uplink_sent_bytes(self) -> int:
        return sent_bytes(self.pair.device_ns, self.pair.device_if)

    def downlink_sent_bytes(self) -> int:
        return sent_bytes(self.pair.edge_ns, self.pair.edge_if)


def describe_shaper(use_netem: bool, uplink: LinkSpec, downlink: LinkSpec) -> str:
    delays = uplink.delays or downlink.delays
    rates = uplink.rate_bps or downlink.rate_bps
    if use_netem:
        return "netem" if (delays or rates) else "none"
    if delays:
        return "tbf+linkemu" if rates else "linkemu"
    return "tbf" if rates else "none"


@contextlib.contextmanager
def testbed(uplink: LinkSpec, downlink: LinkSpec, tag: str | None = None, prefer_netem: bool = True):
    """Create, shape, yield a :class:`Testbed`; always remove the namespaces and links after."""
    pair = Pair.named(tag or secrets.token_hex(5))
    try:
        create_pair(pair)
        use_netem = prefer_netem and netem_available(pair.device_ns, pair.device_if)
        shape(pair.device_ns, pair.device_if, uplink, use_netem)
        shape(pair.edge_ns, pair.edge_if, downlink, use_netem)
        yield Testbed(pair, uplink, downlink, describe_shaper(use_netem, uplink, downlink))
    finally:
        delete_pair(pair)
