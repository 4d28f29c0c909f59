"""Process plumbing shared by both entry points: the event loop and the first lines of logging."""
from __future__ import annotations

import asyncio


def run_async(coro):
    """Run ``coro`` on uvloop (falling back to asyncio's loop if uvloop cannot be imported)."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only guards exotic platforms
        return asyncio.run(coro)
    return uvloop.run(coro)
