"""edge_only.time_drafter: the drafter timed while an edge-only round streams (the safety net's stand-in
for exploring drafting that cannot pay): its timed forwards each feed one verified token, as a drafted
round's do, from where the drafter's cache stands (no prefill of the context first); it waits for
tokens to arrive, and stops when told."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from specdec.device import edge_only


class CountingModel:
    """A drafter's cache: ``feed`` takes what a sequence has beyond it (each forward ``seconds`` long)."""

    def __init__(self, seconds: float = 0.002):
        self.cache_len, self.fed, self.seconds = 0, [], seconds

    def feed(self, seq: list[int]) -> None:
        assert len(seq) > self.cache_len, "a forward needs a token to feed"
        self.fed.append(len(seq) - self.cache_len)
        self.cache_len = len(seq)
        time.sleep(self.seconds)


def host(tokens: list[int], model: CountingModel) -> SimpleNamespace:
    return SimpleNamespace(tokens=tokens, drafting=SimpleNamespace(model=model))


def test_the_timed_forwards_each_feed_one_token_from_where_the_cache_stands() -> None:
    model = CountingModel()
    session = host(list(range(40)), model)
    times = edge_only.time_drafter(session, threading.Event(), threading.Event(), 3)
    assert model.fed == [1, 1, 1] and model.cache_len == 3   # no prefill of the 36 tokens before them
    assert len(times) == 3 and all(t >= model.seconds for t in times)
    model.cache_len = 20   # a cache that read part of the text (a drafted round) goes on from there
    edge_only.time_drafter(session, threading.Event(), threading.Event(), 3)
    assert model.fed[3:] == [1, 1, 1] and model.cache_len == 23


def test_it_waits_for_streamed_tokens_and_stops_when_told() -> None:
    model = CountingModel()
    model.cache_len = 10
    session = host(list(range(12)), model)   # one token to feed, two more to come
    stop, arrived = threading.Event(), threading.Event()
    out: list[tuple[float, ...]] = []
    worker = threading.Thread(target=lambda: out.append(edge_only.time_drafter(session, stop, arrived, 3)))
    worker.start()
    for token in (12, 13):
        time.sleep(0.02)
        session.tokens.append(token)
        arrived.set()
    worker.join(timeout=5)
    assert len(out[0]) == 3 and model.fed == [1, 1, 1] and model.cache_len == 13
    model.cache_len = 13   # caught up: nothing to time until a token arrives; the round ends
    worker = threading.Thread(target=lambda: out.append(edge_only.time_drafter(session, stop, arrived, 3)))
    worker.start()
    stop.set()
    arrived.set()
    worker.join(timeout=5)
    assert not worker.is_alive() and out[1] == ()
