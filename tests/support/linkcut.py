"""A loopback TCP relay whose link can be cut: it drops every open connection and refuses new ones
for a while, as a radio link that goes away does (used to break gRPC streams for resume tests), or
stalled: it holds every byte for a while, as a link in an outage that comes back does."""
from __future__ import annotations

import asyncio
import contextlib
import time

RELAY_CHUNK_BYTES = 65536


class CuttableLink:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.down_until = 0.0
        self.stalled_until = 0.0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> "CuttableLink":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def retarget(self, host: str, port: int) -> None:
        """Send new connections to another server (a restarted edge at a new address)."""
        self.target = (host, port)

    def stall(self, seconds: float) -> None:
        """Hold every byte in both directions for ``seconds`` (connections stay up), as a radio link
        that stops for a moment does; what was held goes on after it."""
        self.stalled_until = time.monotonic() + seconds

    def cut(self, seconds: float) -> None:
        """Drop all connections now and refuse new ones for ``seconds``."""
        self.down_until = time.monotonic() + seconds
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut(0)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _accept(self, reader, writer) -> None:
        if time.monotonic() < self.down_until:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader, writer) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError, OSError):
            while data := await reader.read(RELAY_CHUNK_BYTES):
                if (held := self.stalled_until - time.monotonic()) > 0:
                    await asyncio.sleep(held)
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self.writers.discard(writer)
