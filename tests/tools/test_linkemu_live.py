"""The userspace link emulator changes its link live (``--control``): open connections stay up and
the next bytes see the new delay and rate; later connections too (no root needed, loopback only).

bench/bench_links.py relies on this for the link that changes during a session.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time

import pytest

from specdec.testbed import procs
from specdec.testbed.linkemu import LinkEmulator, LinkSpec, send_control

PING_BYTES = 32
PINGS = 6
# A delay measured through the emulator is at least the one configured, and at most that by a ratio
# and a slack a shared 2-core machine allows (its event loop may wait for a core); the emulator itself
# adds well under a millisecond per chunk.
DELAY_RATIO = 1.5
DELAY_SLACK_S = 0.030


def _delayed(measured: float, configured: float) -> bool:
    return configured <= measured <= configured * DELAY_RATIO + DELAY_SLACK_S


async def _echo(reader, writer) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _rtt(reader, writer, pings: int = PINGS) -> float:
    """Median round trip of small pings on one open connection."""
    times = []
    for _ in range(pings):
        t0 = time.monotonic()
        writer.write(b"x" * PING_BYTES)
        await writer.drain()
        await reader.readexactly(PING_BYTES)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


async def _bulk_seconds(reader, writer, nbytes: int) -> float:
    """Time to send ``nbytes`` up and get them echoed back."""
    t0 = time.monotonic()
    writer.write(b"y" * nbytes)
    await writer.drain()
    await reader.readexactly(nbytes)
    return time.monotonic() - t0


def test_live_change_applies_to_open_and_new_connections() -> None:
    async def scenario() -> dict:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        emu = LinkEmulator(("127.0.0.1", echo.sockets[0].getsockname()[1]),
                           LinkSpec(delay_s=0.005), LinkSpec(delay_s=0.005))
        port = await emu.start()
        control = await emu.start_control("127.0.0.1:0")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            before = await _rtt(reader, writer)
            reply = await asyncio.to_thread(send_control, control, {
                "uplink": {"delay_s": 0.05, "rate_bps": 1e6}, "downlink": {"delay_s": 0.03}})
            after = await _rtt(reader, writer)                 # the same, still open connection
            bulk = await _bulk_seconds(reader, writer, 25_000)  # 0.2 s at 1 Mbit/s on the uplink
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            fresh = await _rtt(r2, w2)                         # a connection opened after the change
            back = await asyncio.to_thread(send_control, control, {"uplink": {}, "downlink": {}})
            restored = await _rtt(reader, writer)
            bad = None
            try:
                await asyncio.to_thread(send_control, control, {"uplink": {"delay_s": -1}})
            except RuntimeError as exc:
                bad = str(exc)
            query = await asyncio.to_thread(send_control, control, {})
            for w in (writer, w2):
                w.close()
            return {"before": before, "after": after, "bulk": bulk, "fresh": fresh, "restored": restored,
                    "reply": reply, "back": back, "bad": bad, "query": query}
        finally:
            await emu.close()
            echo.close()

    m = asyncio.run(scenario())
    print({k: v for k, v in m.items() if isinstance(v, float)})
    assert m["reply"]["ok"] and m["reply"]["connections"] == 1
    assert m["reply"]["uplink"]["delay_s"] == 0.05 and m["reply"]["uplink"]["rate_bps"] == 1e6
    assert _delayed(m["before"], 0.010)
    assert _delayed(m["after"], 0.080) and m["after"] > 2 * m["before"]   # the open connection changed
    assert _delayed(m["fresh"], 0.080)
    assert m["bulk"] >= 0.080 + 25_000 * 8 / 1e6 * 0.9
    assert _delayed(m["restored"], 0.0) and m["restored"] < m["after"] / 2   # and changed back
    assert m["back"]["uplink"] == LinkSpec().to_json()
    assert m["bad"] and "invalid link" in m["bad"]
    assert m["query"]["uplink"] == LinkSpec().to_json()  # the refused change left the link as it was


def test_control_message_validation() -> None:
    emu = LinkEmulator(("127.0.0.1", 1), LinkSpec(delay_s=0.01), LinkSpec())
    for bad in ([], {"sideways": {}}, {"uplink": {"speed": 1}}, {"uplink": {"loss": 1.5}},
                {"uplink": {"delay_s": 0.1}, "downlink": {"rate_bps": "fast"}}):
        with pytest.raises(ValueError):
            emu.apply_control(bad)
    assert emu.uplink == LinkSpec(delay_s=0.01)  # all or nothing: the valid uplink was not applied
    assert emu.apply_control({"downlink": {"delay_s": "0.02"}})["downlink"]["delay_s"] == 0.02
    assert emu.uplink == LinkSpec(delay_s=0.01)  # a direction left out is kept


def test_the_control_reply_says_when_the_bytes_inside_the_link_have_left() -> None:
    """``idle_in_s``: what a bench waits before starting a session on a fresh link (bytes of one
    connection leave in order, so later ones would queue behind those still inside)."""
    hold_s = 0.4

    async def scenario() -> tuple[float, float, float]:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        emu = LinkEmulator(("127.0.0.1", echo.sockets[0].getsockname()[1]), LinkSpec(delay_s=hold_s), LinkSpec())
        port = await emu.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            empty = emu.apply_control({})["idle_in_s"]
            writer.write(b"z" * PING_BYTES)
            await writer.drain()
            await asyncio.sleep(0.05)  # read into the link, not out of it yet
            inside = emu.apply_control({})["idle_in_s"]
            await reader.readexactly(PING_BYTES)
            drained = emu.apply_control({})["idle_in_s"]
            writer.close()
            return empty, inside, drained
        finally:
            await emu.close()
            echo.close()

    empty, inside, drained = asyncio.run(scenario())
    assert empty == 0.0 and drained == 0.0
    assert 0.2 < inside <= hold_s, inside  # the ping's release, ~hold_s after it was read


def test_command_line_control_on_a_unix_socket(tmp_path) -> None:
    """The process the benchmark starts: the control line comes before the ready line, and a unix
    socket (reachable from another network namespace) changes the link of the running emulator."""
    server = procs.ReadyProcess(procs.python_module("specdec.testbed.probe", "serve", "--listen", "127.0.0.1:0"),
                                name="probe", env=procs.child_env())
    path = tmp_path / "ctl.sock"
    emu = None
    try:
        emu = procs.ReadyProcess(procs.python_module(
            "specdec.testbed.linkemu", "--connect", f"127.0.0.1:{server.port}", "--up-delay", "10ms",
            "--control", f"unix:{path}"), name="linkemu", env=procs.child_env())
        assert any(line.startswith(f"linkemu control on unix:{path}") for line in emu.lines), emu.lines
        reply = send_control(f"unix:{path}", {"uplink": {"delay_s": 0.04}})
        assert reply["ok"] and reply["uplink"]["delay_s"] == 0.04 and reply["downlink"]["delay_s"] == 0.0
        r = subprocess.run(procs.python_module("specdec.testbed.probe", "measure", "--connect", emu.address,
                                               "--up-bytes", "20000", "--down-bytes", "20000", "--probes", "6"),
                           capture_output=True, text=True, timeout=60, env=procs.child_env())
        assert r.returncode == 0, r.stderr
        up_delay = json.loads(r.stdout)["up_delay_s"]
        assert _delayed(up_delay, 0.04), up_delay
    finally:
        for p in (emu, server):
            if p is not None:
                p.stop()
