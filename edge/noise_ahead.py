"""Noise drawn while the forward runs: the race and bonus noise of a round, drawn by its session's
thread while the target forward it waits for runs, instead of by the scheduler after it.

At T > 0 a gumbel round reads ``V`` exponentials at each position it reaches (its race, Daliri et al.
2024 §4; an edge-only token is a race too), and a chain round whose drafts are all accepted ``V``
Gumbels for its coupled bonus. They come from each session's CPU streams (common/streams.py), since
the device draws the very same numbers, so a GPU cannot draw them: at ``V`` = 128k that is ~1 ms of
host work a position, which the scheduler's thread would otherwise spend after each forward, inside
every batched round's verification (32 gumbel sessions x 5 positions: more than an ~8B forward on
an H200). A session's thread waits idle for that forward; it draws the noise its round may read in
the order verification reads it (position 0 first), keeps what it drew (:class:`Memo`), and stops once
the forward's answer is there. Verification reads the kept draws, draws what is missing itself, and
waits for a draw under way rather than drawing it twice.

The numbers are the same whoever draws them (each is its stream's, keyed by seed and position), so
no token changes; what it costs is the draws of positions past a rejection, on cores that would idle
during a GPU forward. On a CPU edge those cores run the forward (and its devices), so it is off there
(``DeviceDefaults.noise_ahead``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from specdec.edge.verify_batch import ChainRound

NOISE_AHEAD = ("auto", "on", "off")


class Memo:
    """A noise function whose draws are kept: each key is drawn once, by whichever thread asks first;
    one that asks while it is being drawn waits for it."""

    def __init__(self, draw: Callable[..., torch.Tensor]):
        self._draw = draw
        self._lock = threading.Lock()
        self._kept: dict[tuple, torch.Tensor] = {}
        self._drawing: dict[tuple, threading.Lock] = {}

    def __call__(self, *key) -> torch.Tensor:
        with self._lock:
            if key in self._kept:
                return self._kept[key]
            mine = self._drawing.setdefault(key, threading.Lock())
        with mine:  # a second caller waits here for the first one's draw
            with self._lock:
                if key in self._kept:
                    return self._kept[key]
            value = self._draw(*key)
            with self._lock:
                self._kept[key] = value
                del self._drawing[key]
            return value

    def drawn(self, *key) -> bool:
        with self._lock:
            return key in self._kept


def kept(round_: ChainRound) -> ChainRound:
    """``round_`` with its noise functions keeping their draws (:class:`Memo`), at T > 0; at T = 0 as it
    is (the target is one-hot: no noise is drawn)."""
    if round_.law.temperature == 0:
        return round_
    return replace(round_, token_noise=Memo(round_.token_noise) if round_.token_noise is not None else None,
                   bonus_noise=Memo(round_.bonus_noise) if callable(round_.bonus_noise) else round_.bonus_noise)


def draw_ahead(round_: ChainRound, done: Callable[[], bool]) -> int:
    """Draw the noise ``round_`` may read, where it is kept (:class:`Memo`): a gumbel race's positions
    0..L in order, or the coupled bonus's; stop as soon as ``done()`` (its answer is there: a draw
    nobody reads must not hold the session). Returns how many were drawn here. A draw that fails is
    left to verification, which fails the round with it as it would have without drawing ahead."""
    keys = [(round_.token_noise, (i,)) for i in range(round_.length + 1)] if isinstance(round_.token_noise, Memo) else []
    if isinstance(round_.bonus_noise, Memo):
        keys.append((round_.bonus_noise, ()))
    draws = 0
    for memo, key in keys:
        if done():
            break
        if memo.drawn(*key):
            continue
        try:
            memo(*key)
        except Exception:  # noqa: BLE001 - verification draws it again and fails the round with it
            break
        draws += 1
    return draws
