"""`make testbed`: edge-server and device-client in two namespaces joined by a shaped veth link.

    python -m specdec.testbed --up-rate 1mbit --up-delay 20ms --down-rate 10mbit --down-delay 20ms \\
        [--edge-arg=--model --edge-arg=DIR ...] [-- DEVICE-CLIENT ARGS]

Needs root (namespaces, tc). Prints which shaper carries what, the device-client's output, and the
bytes the kernel's qdiscs sent each way. Everything it creates is removed when it ends.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from specdec.common.runtime import OneLineParser
from specdec.testbed import procs
from specdec.testbed.linkemu import LinkSpec
from specdec.testbed.netns import testbed
from specdec.testbed.units import argtype, parse_percent, parse_rate, parse_time

DEFAULT_DEVICE_ARGS = ["--prompt", "What is the capital of France? Answer in one sentence.",
                       "--max-new-tokens", "32", "--json"]
DEVICE_TIMEOUT_S = 1800.0  # a long answer over a slow link with the embedded models on 2 cores
SHAPERS = {
    "netem": "netem in the kernel: rate, delay, jitter and loss per direction",
    "tbf+linkemu": "no netem in this kernel: tbf limits the rate, the userspace link emulator adds "
                   "delay, jitter and loss (loss as retransmission delay)",
    "linkemu": "no netem in this kernel: the userspace link emulator adds delay, jitter and loss",
    "tbf": "no netem in this kernel: tbf limits the rate (no delay, jitter or loss asked for)",
    "none": "no shaping asked for",
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m specdec.testbed", description=__doc__.split("\n\n")[0])
    for side, name in (("up", "uplink (device -> edge)"), ("down", "downlink (edge -> device)")):
        p.add_argument(f"--{side}-rate", type=argtype(parse_rate), default=0.0, help=f"{name} rate, e.g. 1mbit")
        p.add_argument(f"--{side}-delay", type=argtype(parse_time), default=0.0, help=f"{name} one-way delay")
        p.add_argument(f"--{side}-jitter", type=argtype(parse_time), default=0.0, help=f"{name} jitter (+-)")
        p.add_argument(f"--{side}-loss", type=argtype(parse_percent), default=0.0, help=f"{name} loss, e.g. 1%%")
    p.add_argument("--no-netem", action="store_true", help="use tbf + the link emulator even where netem exists")
    p.add_argument("--edge-arg", action="append", default=[], help="one edge-server argument (repeatable)")
    p.add_argument("device_args", nargs="*", help="device-client arguments (after --)")
    return p


def run(args) -> int:
    up = LinkSpec(args.up_rate, args.up_delay, args.up_jitter, args.up_loss)
    down = LinkSpec(args.down_rate, args.down_delay, args.down_jitter, args.down_loss)
    started: list[procs.NsProcess] = []
    with testbed(up, down, prefer_netem=not args.no_netem) as tb:
        print(f"testbed: shaper={tb.shaper}: {SHAPERS[tb.shaper]}", flush=True)
        try:
            port = procs.start_edge(tb, args.edge_arg, started)
            address = procs.device_side_address(tb, port, started)
            before = tb.uplink_sent_bytes(), tb.downlink_sent_bytes()
            r = procs.run_in_device_ns(tb, procs.device_cmd(address, args.device_args or DEFAULT_DEVICE_ARGS),
                                       timeout=DEVICE_TIMEOUT_S)
            sent = tb.uplink_sent_bytes() - before[0], tb.downlink_sent_bytes() - before[1]
        finally:
            procs.stop_all(started)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    print(json.dumps({"shaper": tb.shaper, "uplink_wire_bytes": sent[0], "downlink_wire_bytes": sent[1]}))
    return r.returncode


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.geteuid() != 0:
        sys.stderr.write("testbed: error: needs root (network namespaces and tc); "
                         "without root use python -m specdec.testbed.linkemu on loopback\n")
        return 2
    if not (shutil.which("ip") and shutil.which("tc")):
        sys.stderr.write("testbed: error: needs iproute2 (ip, tc)\n")
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
