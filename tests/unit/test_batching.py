"""Batched target forwards (common/batched.py) and the edge's forward scheduler (edge/batching.py).

A tiny random Llama saved to disk and loaded through the product's loader; every batched result is
compared with the same sequence run alone, which is what the edge did before batching.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specdec.common.batched import ForwardRequest, forward_batch
from specdec.common.loadaware import CostCurve
from specdec.common.modeling import CachedLM, ModelSpec, load_model
from specdec.common.treeplan import edge_tree_inputs
from specdec.common.tree import TreeSpec
from specdec.edge.batching import BatchSettings, ForwardScheduler
from specdec.testbed.tiny_models import make_model

VOCAB = 64
# Padded batches reorder float sums: logits agree to ~1e-5 here (logit scale 4); a wrong mask or
# position is off by O(1).
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("batching") / "t", VOCAB, seed=1)
    return load_model(ModelSpec(model=str(path)))


def ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=gen).tolist()


def twins(model, prefix: list[int]) -> tuple[CachedLM, CachedLM]:
    """Two runners holding the same prefix: one runs alone, the other in batches."""
    pair = CachedLM(model.model, model.device), CachedLM(model.model, model.device)
    for lm in pair:
        if prefix:
            lm.forward(prefix, 1)
    return pair


def assert_same_cache(a: CachedLM, b: CachedLM) -> None:
    assert a.cache_len == b.cache_len
    for la, lb in zip(a.cache.layers, b.cache.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(la.values, lb.values, atol=ATOL, rtol=0)


def test_batched_chains_equal_alone_and_caches_continue(model):
    gen = torch.Generator().manual_seed(0)
    prefixes = [ids(gen, 5), ids(gen, 1), ids(gen, 12), [], ids(gen, 3)]  # an empty cache too
    news = [ids(gen, n) for n in (3, 1, 5, 7, 2)]
    pairs = [twins(model, p) for p in prefixes]
    alone = [a.forward(n, len(n)) for (a, _), n in zip(pairs, news)]
    batched = forward_batch([ForwardRequest(b, n, len(n)) for (_, b), n in zip(pairs, news)])
    for x, y in zip(alone, batched):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for a, b in pairs:
        assert_same_cache(a, b)
    # The caches a batch appended to serve the next forward as their own would.
    nxt = [ids(gen, 2) for _ in pairs]
    again = forward_batch([ForwardRequest(b, n, 1) for (_, b), n in zip(pairs, nxt)])
    for (a, _), n, y in zip(pairs, nxt, again):
        torch.testing.assert_close(a.forward(n, 1), y, atol=ATOL, rtol=0)


def test_batched_tree_beside_chains_equals_alone(model):
    gen = torch.Generator().manual_seed(1)
    spec = TreeSpec.from_config((2, 2))
    tree_pair = twins(model, ids(gen, 6))
    tail = ids(gen, 1)  # one verified token not yet cached
    nodes = ids(gen, spec.num_nodes - 1)
    attend, positions = edge_tree_inputs(spec, tree_pair[0].cache_len, len(tail))
    alone_tree = tree_pair[0].forward_masked(tail + nodes, attend, positions, spec.num_nodes)
    chain_pair = twins(model, ids(gen, 9))
    chain_new = ids(gen, 4)
    alone_chain = chain_pair[0].forward(chain_new, 5 - 1)
    tree_out, chain_out = forward_batch([
        ForwardRequest(tree_pair[1], tail + nodes, spec.num_nodes, attend=attend, positions=positions),
        ForwardRequest(chain_pair[1], chain_new, 4)])
    torch.testing.assert_close(alone_tree, tree_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(alone_chain, chain_out, atol=ATOL, rtol=0)
    assert_same_cache(*tree_pair)


def test_prefill_request_without_logits(model):
    gen = torch.Generator().manual_seed(2)
    a, b = twins(model, [])
    c, d = twins(model, ids(gen, 4))
    prompt = ids(gen, 10)
    a.forward(prompt, 1)
    out = forward_batch([ForwardRequest(b, prompt, 0), ForwardRequest(d, ids(gen, 2), 1)])
    assert out[0].shape == (0, VOCAB) and out[1].shape == (1, VOCAB)
    assert_same_cache(a, b)


def test_batch_rejects_an_empty_request(model):
    a, _ = twins(model, [5])
    b, _ = twins(model, [6])
    with pytest.raises(ValueError, match="at least one new token"):
        forward_batch([ForwardRequest(a, [7], 1), ForwardRequest(b, [], 1)])


# ------------------------------------------------------------------------------------- scheduler
def run_threads(scheduler: ForwardScheduler, jobs) -> list:
    """Each job in its own 'session' thread inside scheduler.working(); results in job order."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def one(i, job):
        with scheduler.working():
            start.wait()
            try:
                results[i] = job()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                results[i] = exc

    threads = [threading.Thread(target=one, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_scheduler_runs_ready_sessions_in_one_forward(model):
    gen = torch.Generator().manual_seed(3)
    stats = []
    # A long window: the forward must start because all four handed in, not because time ran out.
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0), observer=stats.append)
    try:
        pairs = [twins(model, ids(gen, 3 + i)) for i in range(4)]
        news = [ids(gen, 2 + i) for i in range(4)]
        out = run_threads(scheduler, [lambda b=b, n=n: scheduler.forward(ForwardRequest(b, n, len(n)))
                                      for (_, b), n in zip(pairs, news)])
    finally:
        scheduler.stop()
    assert [s.sessions for s in stats] == [4]
    assert stats[0].tokens == sum(len(n) for n in news)
    for (a, _), n, y in zip(pairs, news, out):
        torch.testing.assert_close(a.forward(n, len(n)), y, atol=ATOL, rtol=0)


def test_scheduler_caps_tokens_oldest_first_and_chunks_long_prompts(model):
    gen = torch.Generator().manual_seed(4)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(max_batch_tokens=8, wait_s=0.0), observer=stats.append)
    try:
        a, b = twins(model, [])
        prompt = ids(gen, 21)  # 3 chunks of <= 8
        logits = scheduler.forward(ForwardRequest(b, prompt, 2))
    finally:
        scheduler.stop()
    assert [s.tokens for s in stats] == [8, 8, 5]
    torch.testing.assert_close(a.forward(prompt, 2), logits, atol=ATOL, rtol=0)
    assert_same_cache(a, b)


def test_scheduler_takes_requests_in_arrival_order_within_the_cap(model):
    gen = torch.Generator().manual_seed(5)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(max_batch_tokens=6, wait_s=30.0), observer=stats.append)
    try:
        lms = [twins(model, ids(gen, 2))[1] for _ in range(3)]
        # 4 + 4 + 2 tokens, cap 6: the first alone (the second would exceed it), then the other two.
        run_threads(scheduler, [lambda lm=lm, n=n: scheduler.forward(ForwardRequest(lm, ids(gen, n), 1))
                                for lm, n in zip(lms, (4, 4, 2))])
    finally:
        scheduler.stop()
    assert sum(s.sessions for s in stats) == 3
    assert all(s.tokens <= 6 for s in stats)


def test_a_failing_request_fails_only_its_own_session(model):
    gen = torch.Generator().manual_seed(6)
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0))
    try:
        good, _ = twins(model, ids(gen, 3))
        bad, _ = twins(model, ids(gen, 3))
        ref, _ = twins(model, [])
        news = ids(gen, 2)
        wrong = torch.ones(2, 1, dtype=torch.bool)  # a tree mask that fits no cache of 3
        out = run_threads(scheduler, [
            lambda: scheduler.forward(ForwardRequest(good, news, 1)),
            lambda: scheduler.forward(ForwardRequest(bad, ids(gen, 2), 1, attend=wrong,
                                                     positions=torch.arange(2)))])
    finally:
        scheduler.stop()
    assert isinstance(out[1], ValueError)
    assert isinstance(out[0], torch.Tensor) and out[0].shape == (1, VOCAB)
    assert good.cache_len == 5 and bad.cache_len == 3  # the failed one's cache is untouched


def test_stopped_scheduler_refuses_work(model):
    scheduler = ForwardScheduler(BatchSettings())
    scheduler.stop()
    lm, _ = twins(model, [3])
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.forward(ForwardRequest(lm, [4], 1))


def test_sessions_due_back_are_waited_for_so_they_do_not_fall_into_lockstep(model):
    """Two sessions whose gap between forwards (20 ms: round trip and drafting) is shorter than a
    forward: without waiting for the one due back, each forward would serve one of them while the
    other waits. With the join window they share forwards once the scheduler has seen their gaps."""
    gen = torch.Generator().manual_seed(7)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(wait_s=0.0), observer=stats.append)
    scheduler.cost = CostCurve({1: 0.2, 256: 0.2})  # flat: one shared forward saves a whole 0.2 s
    try:
        lms = [twins(model, ids(gen, 3))[1] for _ in range(2)]

        def session(lm, delay):
            time.sleep(delay)
            for _ in range(8):
                with scheduler.working():
                    scheduler.forward(ForwardRequest(lm, [5], 1))
                time.sleep(0.02)

        threads = [threading.Thread(target=session, args=(lm, d)) for lm, d in zip(lms, (0.0, 0.01))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        scheduler.stop()
    assert sum(s.sessions for s in stats) == 16
    # 10 ms apart and a 2 ms forward: without the wait every forward would serve one session
    assert sum(s.sessions == 2 for s in stats) >= 5, [s.sessions for s in stats]


def test_a_session_that_left_is_not_waited_for(model):
    gen = torch.Generator().manual_seed(8)
    scheduler = ForwardScheduler(BatchSettings(wait_s=0.0))
    scheduler.cost = CostCurve({1: 2.0, 256: 2.0})  # sharing a forward would save 2 s
    try:
        gone, stays = (twins(model, ids(gen, 3))[1] for _ in range(2))
        for lm in (gone, stays, gone):
            scheduler.forward(ForwardRequest(lm, [5], 1))  # 'gone' gets a gap, then is due back
        scheduler.forget(gone)
        start = time.perf_counter()
        scheduler.forward(ForwardRequest(stays, [6], 1))
        assert time.perf_counter() - start < 0.5
    finally:
        scheduler.stop()
