"""Fixtures of the tools' tests."""
from __future__ import annotations

import pytest

from specdec.testbed import linkemu


@pytest.fixture
def linkemu_never_serves(monkeypatch):
    """linkemu's main run in this process fails at once, instead of serving forever, if a bad flag got
    through its checks."""
    async def serve(args):
        raise AssertionError(f"linkemu would serve with {args}")
    monkeypatch.setattr(linkemu, "_serve", serve)
