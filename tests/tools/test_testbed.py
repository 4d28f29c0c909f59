"""The shaped-link testbed: link model, shaping commands, and measurements through real links.

Through real links, a rate and a one-way delay configured on the testbed are what a transfer
measures (within 10%), and a device-client run behind a 1 Mbit/s uplink reports bytes and times that
the rate explains. Namespace tests need root and iproute2 (CI runs as root); each test makes its
own uniquely named namespaces and removes them in a ``finally``, also when it fails.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest
from tests.support.harness import ROOT, run_main

from specdec.testbed import __main__ as testbed_cli
from specdec.testbed import linkemu, netns, probe, procs
from specdec.testbed.linkemu import LinkClock, LinkSpec
from specdec.testbed.units import parse_percent, parse_rate, parse_time

WIRE_TIME_MARGIN = 1.15   # a device's network time over what its wire bytes need at the rate, at most
ROUND_SLACK_S = 0.020     # per round: loopback round trips and scheduling stalls on shared cores
RATE_TOLERANCE = 0.10
DELAY_TOLERANCE = 0.10  # on the least one-way delay of the probes (see testbed.probe.measure)
# Goodput is the rate times the payload share of a frame: TCP payload 1448 of 1514 bytes tc counts.
PAYLOAD_SHARE = 1448 / 1514
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                                reason="network namespaces and tc need root and iproute2")


# -- the link model and the commands (pure, fast) --------------------------------------------------

def test_link_clock_serializes_at_the_rate_then_delays() -> None:
    clock = LinkClock(LinkSpec(rate_bps=1e6, delay_s=0.05), random.Random(0))
    # 1250 bytes at 1 Mbit/s take 10 ms on the wire; back-to-back chunks queue behind each other.
    assert [round(clock.release_time(1250, 0.0), 6) for _ in range(3)] == [0.06, 0.07, 0.08]
    assert clock.release_time(1250, 1.0) == pytest.approx(1.06)  # an idle link starts afresh


def test_link_clock_never_reorders_and_loss_costs_whole_timeouts() -> None:
    jittery = LinkClock(LinkSpec(delay_s=0.05, jitter_s=0.04), random.Random(1))
    times = [jittery.release_time(100, i * 0.001) for i in range(500)]
    assert times == sorted(times)
    lossy = LinkClock(LinkSpec(loss=0.5, rto_s=1.0), random.Random(2))
    extra = [lossy.release_time(1448, 10.0 * i) - 10.0 * i for i in range(200)]
    assert set(extra) == {0.0, 1.0} and 60 < extra.count(1.0) < 140


def test_units_parse_like_tc() -> None:
    assert parse_rate("1mbit") == 1e6 and parse_rate("250kbit") == 2.5e5 and parse_rate("1mbps") == 8e6
    assert parse_time("20ms") == pytest.approx(0.02) and parse_time("1.5s") == 1.5
    assert parse_percent("1%") == pytest.approx(0.01)
    for bad in ("fast", "1 parsec", ""):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_shaping_commands() -> None:
    spec = LinkSpec(rate_bps=1e6, delay_s=0.02, jitter_s=0.005, loss=0.01)
    assert netns.netem_args("vdx", spec) == [
        "qdisc", "replace", "dev", "vdx", "root", "netem", "limit", "10000",
        "delay", "20000us", "5000us", "loss", "1%", "rate", "1000000bit"]
    tbf = netns.tbf_args("vdx", spec)
    assert tbf[:8] == ["qdisc", "replace", "dev", "vdx", "root", "tbf", "rate", "1000000bit"]
    assert int(tbf[tbf.index("burst") + 1]) >= 1514  # the bucket must hold a full frame
    assert netns.describe_shaper(False, spec, LinkSpec()) == "tbf+linkemu"
    assert netns.describe_shaper(False, LinkSpec(rate_bps=1e6), LinkSpec()) == "tbf"
    assert netns.describe_shaper(True, spec, LinkSpec()) == "netem"


def test_tc_stats_parse() -> None:
    out = "qdisc tbf 8001: root refcnt 2 rate 1Mbit burst 1600b lat 50ms\n Sent 204494 bytes 180 pkt (dropped 0)"
    assert netns.parse_sent_bytes(out) == 204494


# -- the userspace emulator on loopback (no root) -------------------------------------------------

def _loopback_process(*cmd: str) -> procs.ReadyProcess:
    """A testbed module (probe, linkemu) on loopback, started as the testbed starts it."""
    return procs.ReadyProcess(list(cmd), name=cmd[2], env=procs.child_env())


# Scheduling priority (nice) of a rate test's own processes (probe ends, delay emulator), above the suite's
# other worker: the emulator stands in for the kernel's netem, which no user process starves. Beside the
# fuzzer's and Prometheus's tests, all three transfers a direction measured 1.72-1.75 of 2 Mbit/s (a clean
# clone's run) and 3.57-3.60 of 4; at this priority, beside the same tests, 1.90-1.91 and 3.78-3.82.
FAVOURED_NICE = -10


def _measure(address: str, up_bytes: int, down_bytes: int, probes: int, ns: str | None = None,
             transfers: int = 1, nice: int = 0) -> dict:
    cmd = procs.python_module("specdec.testbed.probe", "measure", "--connect", address, "--up-bytes", str(up_bytes),
                              "--down-bytes", str(down_bytes), "--probes", str(probes), "--transfers", str(transfers))
    cmd = netns.in_ns(ns, *cmd) if ns else cmd
    favour = (lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) if nice else None
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=procs.child_env(), preexec_fn=favour)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _assert_within(measured: float, expected: float, tolerance: float, what: str) -> None:
    assert abs(measured / expected - 1) <= tolerance, f"{what}: measured {measured:.4g}, expected {expected:.4g}"


def test_userspace_emulator_rate_and_delay_without_root() -> None:
    server = _loopback_process(*procs.python_module("specdec.testbed.probe", "serve", "--listen", "127.0.0.1:0"))
    emu = None
    try:
        emu = _loopback_process(*procs.python_module(
            "specdec.testbed.linkemu", "--connect", f"127.0.0.1:{server.port}", "--up-rate", "2mbit",
            "--up-delay", "60ms", "--down-rate", "4mbit", "--down-delay", "40ms"))
        m = _measure(f"127.0.0.1:{emu.port}", 400_000, 800_000, probes=12)
    finally:
        for p in (emu, server):
            if p is not None:
                p.stop()
    print(f"linkemu on loopback: up={m['up']['bps']:.0f} bit/s down={m['down']['bps']:.0f} bit/s "
          f"up_delay={m['up_delay_s'] * 1e3:.2f} ms down_delay={m['down_delay_s'] * 1e3:.2f} ms "
          f"(medians {m['up_delay_median_s'] * 1e3:.2f} / {m['down_delay_median_s'] * 1e3:.2f} ms)")
    # The emulator limits payload bytes, so goodput is the configured rate itself here.
    _assert_within(m["up"]["bps"], 2e6, RATE_TOLERANCE, "uplink rate")
    _assert_within(m["down"]["bps"], 4e6, RATE_TOLERANCE, "downlink rate")
    _assert_within(m["up_delay_s"], 0.060, DELAY_TOLERANCE, "uplink delay")
    _assert_within(m["down_delay_s"], 0.040, DELAY_TOLERANCE, "downlink delay")


# -- namespaces (root) ----------------------------------------------------------------------------

def _link_exists(dev: str) -> bool:
    return subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode == 0


def _leftovers(pair: netns.Pair) -> list[str]:
    names = netns.namespaces()
    return ([ns for ns in (pair.edge_ns, pair.device_ns) if ns in names]
            + [dev for dev in (pair.edge_if, pair.device_if) if _link_exists(dev)])


@needs_root
def test_namespaces_and_links_are_removed_even_on_failure() -> None:
    seen = {}
    with pytest.raises(RuntimeError, match="boom"):
        with netns.testbed(LinkSpec(rate_bps=1e6, delay_s=0.01), LinkSpec()) as tb:
            seen["pair"] = tb.pair
            started: list[procs.NsProcess] = []
            procs.start_probe_server(tb, started)  # left running on purpose: cleanup must kill it
            assert set(_leftovers(tb.pair)) == {tb.pair.edge_ns, tb.pair.device_ns}
            raise RuntimeError("boom")
    assert _leftovers(seen["pair"]) == []
    assert started[0].proc.wait(timeout=10) is not None


@needs_root
def test_testbed_rate_and_delay_are_what_a_transfer_measures() -> None:
    up, down = LinkSpec(rate_bps=2e6, delay_s=0.06), LinkSpec(rate_bps=4e6, delay_s=0.04)
    started: list[procs.NsProcess] = []
    with netns.testbed(up, down) as tb:
        try:
            port = procs.start_probe_server(tb, started)
            address = procs.device_side_address(tb, port, started)
            for p in started:  # (`ip netns exec` execs the command: its pid is the program's)
                os.setpriority(os.PRIO_PROCESS, p.proc.pid, FAVOURED_NICE)
            # The fastest of 3 transfers a direction: the least delay's reason (testbed/probe.py); one
            # transfer under the suite's other worker measured 1.77 and 3.02 Mbit/s here (CI).
            m = _measure(address, 500_000, 1_000_000, probes=12, ns=tb.pair.device_ns, transfers=3,
                         nice=FAVOURED_NICE)
        finally:
            procs.stop_all(started)
    print("transfers (bit/s): " + ", ".join(f"{side} {[round(t['bps']) for t in m[f'{side}_transfers']]}"
                                            for side in ("up", "down")))
    print(f"shaper={tb.shaper} up={m['up']['bps']:.0f} bit/s down={m['down']['bps']:.0f} bit/s "
          f"up_delay={m['up_delay_s'] * 1e3:.2f} ms down_delay={m['down_delay_s'] * 1e3:.2f} ms "
          f"(medians {m['up_delay_median_s'] * 1e3:.2f} / {m['down_delay_median_s'] * 1e3:.2f} ms)")
    assert tb.shaper in ("netem", "tbf+linkemu")
    _assert_within(m["up"]["bps"], 2e6, RATE_TOLERANCE, "uplink rate")
    _assert_within(m["down"]["bps"], 4e6, RATE_TOLERANCE, "downlink rate")
    # Frame headers are the only gap between goodput and the kernel's rate: tighter check.
    _assert_within(m["up"]["bps"], 2e6 * PAYLOAD_SHARE, 0.03, "uplink goodput")
    _assert_within(m["up_delay_s"], 0.06, DELAY_TOLERANCE, "uplink delay")
    _assert_within(m["down_delay_s"], 0.04, DELAY_TOLERANCE, "downlink delay")


@needs_root
def test_device_client_through_a_1mbit_uplink(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    rate = 1e6
    up, down = LinkSpec(rate_bps=rate), LinkSpec()
    started: list[procs.NsProcess] = []
    with netns.testbed(up, down) as tb:
        try:
            port = procs.start_edge(tb, ["--model", str(target_dir)], started)
            address = procs.device_side_address(tb, port, started)
            wire_before = tb.uplink_sent_bytes()
            # Dense fp32 over 512 tokens: 2 KB per drafted token, so the uplink dominates each round.
            r = procs.run_in_device_ns(tb, procs.device_cmd(address, [
                "--draft-model", str(drafter_dir), "--prompt", "w5 w6 w7", "--raw", "--mode", "dense",
                "--dense-dtype", "fp32", "--draft-len", "8", "--max-new-tokens", "16",
                "--temperature", "1", "--json"]), timeout=180)
            wire = tb.uplink_sent_bytes() - wire_before
        finally:
            procs.stop_all(started)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.splitlines()[-1])["stats"]
    _check_device_run(stats, wire, rate, tb.shaper)


def _check_device_run(stats: dict, wire: int, rate: float, shaper: str) -> None:
    """The device's bytes are what crossed the link, and its network time is what the rate needs.

    Bytes: the uplink's wire count (tc, frames with headers, plus the Hello/Prompt set-up and the
    acks of the downlink) is at least the serialized bytes the device reports and at most ~15% more.
    Time: the device's network time (round trips net of edge time) must cover the reported uplink
    bytes at the rate, less at most one token bucket per round (tbf lets a bucket out at line speed
    after an idle pause), and cannot exceed the wire bytes' serialization by more than 15% + 20 ms per
    round (loopback round trips, and the scheduling stalls of a shared 2-core machine).
    """
    uplink, rounds, network = stats["uplink_bytes"], stats["rounds"], stats["time"]["network"]
    print(f"shaper={shaper} rounds={rounds} uplink_bytes={uplink} wire_bytes={wire} "
          f"network_s={network:.3f} wall_s={stats['wall_seconds']:.3f} "
          f"uplink_bytes*8/rate={uplink * 8 / rate:.3f} s implied_rate={uplink * 8 / network:.0f} bit/s")
    assert uplink <= wire <= 1.15 * (uplink + stats["setup_bytes"])
    bucket = netns.TBF_MIN_BURST_BYTES
    lower = (uplink - rounds * bucket) * 8 / rate
    upper = wire * 8 / rate * WIRE_TIME_MARGIN + rounds * ROUND_SLACK_S
    assert lower <= network <= upper, (lower, network, upper)
    assert network <= stats["wall_seconds"]


# -- deploy/netem scripts for real hosts ----------------------------------------------------------

NETEM_DIR = ROOT / "deploy" / "netem"


def _script(name: str, *args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["bash", str(NETEM_DIR / name), *args]
    return subprocess.run(netns.in_ns(ns, *cmd) if ns else cmd, capture_output=True, text=True, timeout=30)


def test_netem_script_shapes_uplink_on_egress_and_downlink_through_ifb() -> None:
    r = _script("shape.sh", "eth0", "--up-rate", "1mbit", "--up-delay", "20ms", "--up-jitter", "5ms",
                "--up-loss", "0.5%", "--down-rate", "10mbit", "--down-delay", "30ms", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "tc qdisc replace dev eth0 root netem limit 10000 delay 20ms 5ms loss 0.5% rate 1mbit" in lines
    assert "ip link add ifbeth0 type ifb" in lines
    assert ("tc filter replace dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 "
            "action mirred egress redirect dev ifbeth0") in lines
    assert "tc qdisc replace dev ifbeth0 root netem limit 10000 delay 30ms rate 10mbit" in lines
    undo = _script("undo.sh", "eth0", "--dry-run").stdout.splitlines()
    assert undo == ["tc qdisc del dev eth0 root", "tc qdisc del dev eth0 ingress", "ip link del ifbeth0"]


def test_netem_script_port_filter_and_bad_flags() -> None:
    lines = _script("shape.sh", "eth0", "--port", "50051", "--up-delay", "10ms", "--dry-run").stdout
    assert "match ip dport 50051 0xffff flowid 1:4" in lines and "match ip sport 50051 0xffff flowid 1:4" in lines
    for args in (["eth0", "--up-rate", "fast"], ["eth0", "--up-loss", "5"], ["eth0", "--bogus", "1"]):
        r = _script("shape.sh", *args, "--dry-run")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@needs_root
def test_netem_scripts_on_a_namespace_interface_then_undo() -> None:
    with netns.testbed(LinkSpec(), LinkSpec()) as tb:
        ns, dev = tb.pair.device_ns, tb.pair.device_if
        r = _script("shape.sh", dev, "--up-delay", "10ms", "--down-delay", "10ms", ns=ns)
        qdiscs = subprocess.run(netns.in_ns(ns, "tc", "qdisc", "show"), capture_output=True, text=True).stdout
        if netns.netem_available(ns, dev):
            assert r.returncode == 0 and qdiscs.count("netem") == 2, (r.stderr, qdiscs)
        else:  # this project's kernels: the script stops at the first netem, saying why
            assert r.returncode != 0 and "qdisc kind is unknown" in r.stderr, r.stderr
        for _ in range(2):  # undo is idempotent
            assert _script("undo.sh", dev, ns=ns).returncode == 0
        after = subprocess.run(netns.in_ns(ns, "tc", "qdisc", "show"), capture_output=True, text=True).stdout
        links = subprocess.run(netns.in_ns(ns, "ip", "-o", "link"), capture_output=True, text=True).stdout
        assert "netem" not in after and "ingress" not in after and f"ifb{dev}"[:15] not in links


@pytest.mark.parametrize("main, args", [
    (linkemu.main, ["--connect", "nowhere"]),
    (linkemu.main, ["--connect", "127.0.0.1:1", "--up-delay", "soon"]),
    (testbed_cli.main, ["--up-rate", "fast"]),
    (probe.main, ["measure"]),
    (probe.main, ["measure", "--connect", "127.0.0.1:1", "--transfers", "0"]),
])
def test_command_lines_reject_bad_flags_in_one_line(main, args, capsys, linkemu_never_serves) -> None:
    rc, err = run_main(main, args, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("module, args", [
    ("specdec.testbed.linkemu", ["--connect", "127.0.0.1:1", "--up-delay", "soon"]),
    ("specdec.testbed", ["--up-rate", "fast"]),
    ("specdec.testbed.probe", ["measure"]),
])
def test_each_program_exits_2_with_one_line(module, args) -> None:
    """One real process per program: the status reaches the shell and stderr holds the one line."""
    r = subprocess.run(procs.python_module(module, *args), capture_output=True, text=True, timeout=30,
                       env=procs.child_env())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
