"""Process plumbing shared by both entry points: the event loop and the first lines of logging."""
from __future__ import annotations

import argparse
import asyncio
import sys


def run_async(coro):
    """Run ``coro`` on uvloop (falling back to asyncio's loop if uvloop cannot be imported)."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only guards exotic platforms
        return asyncio.run(coro)
    return uvloop.run(coro)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (``PROG: error: ...``) and exits with status 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)
