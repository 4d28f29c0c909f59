"""Batched target forwards (edge/batched.py, edge/slots.py) and the edge's forward scheduler
(edge/batching.py).

A tiny random Llama saved to disk and loaded through the product's loader; every batched result is
compared with the same sequence run alone, which is what the edge did before batching. Each forward
test runs with both layouts of the sessions' caches: per-session caches (padded into each batched
forward) and KV slots (one preallocated cache, a row per session).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specdec.edge.batched import BatchWorkspace, ForwardRequest, forward_batch
from specdec.common.loadaware import CostCurve
from specdec.common.modeling import CachedLM, ModelSpec, load_model
from specdec.edge.slots import SlotPool
from specdec.common.treeplan import edge_tree_inputs
from specdec.common.tree import TreeSpec
from specdec.common.sampling import TargetLaw
from specdec.edge.verify_batch import ChainRound, gumbel_round
from specdec.edge.batching import BatchSettings, ForwardScheduler
from specdec.edge.verifier import verify_alone
from specdec.testbed.tiny_models import make_model

VOCAB = 64
# Padded batches reorder float sums: logits agree to ~1e-5 here (logit scale 4); a wrong mask or
# position is off by O(1).
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("batching") / "t", VOCAB, seed=1)
    return load_model(ModelSpec(model=str(path)))


# slots-static: chain forwards as the static shapes a CUDA graph replays (run eagerly: the same code a
# graph captures, which only a GPU can replay; tests/gpu replays it).
LAYOUTS = ("per-session", "slots", "slots-static")


@pytest.fixture(params=LAYOUTS)
def layout(request, model):
    """How the batched side keeps its caches: a function making a new session's runner."""
    if request.param == "per-session":
        return lambda: CachedLM(model.model, model.device)
    pool = SlotPool(model.model, model.device, static="eager" if request.param == "slots-static" else "off")
    return pool.new_lm


def ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=gen).tolist()


def twins(model, prefix: list[int], make=None) -> tuple[CachedLM, CachedLM]:
    """Two runners holding the same prefix: one runs alone (its own cache), the other in batches
    (made by ``make``: a layout; default its own cache too)."""
    pair = CachedLM(model.model, model.device), (make or (lambda: CachedLM(model.model, model.device)))()
    for lm in pair:
        if prefix:
            lm.forward(prefix, 1)
    return pair


def kv(lm) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's [H, cache_len, D] keys and values of a runner, whatever its layout."""
    if getattr(lm, "pool", None) is not None:
        return [(k[lm.slot, :, :lm.length], v[lm.slot, :, :lm.length])
                for k, v in zip(lm.pool.keys, lm.pool.values)]
    return [(layer.keys[0], layer.values[0]) for layer in lm.cache.layers]


def assert_same_cache(a, b) -> None:
    assert a.cache_len == b.cache_len
    for (ka, va), (kb, vb) in zip(kv(a), kv(b)):
        torch.testing.assert_close(ka, kb, atol=ATOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=ATOL, rtol=0)


def test_batched_chains_equal_alone_and_caches_continue(model, layout):
    gen = torch.Generator().manual_seed(0)
    prefixes = [ids(gen, 5), ids(gen, 1), ids(gen, 12), [], ids(gen, 3)]  # an empty cache too
    news = [ids(gen, n) for n in (3, 1, 5, 7, 2)]
    pairs = [twins(model, p, layout) for p in prefixes]
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


def test_batched_tree_beside_chains_equals_alone(model, layout):
    gen = torch.Generator().manual_seed(1)
    spec = TreeSpec.from_config((2, 2))
    tree_pair = twins(model, ids(gen, 6), layout)
    tail = ids(gen, 1)  # one verified token not yet cached
    nodes = ids(gen, spec.num_nodes - 1)
    attend, positions = edge_tree_inputs(spec, tree_pair[0].cache_len, len(tail))
    alone_tree = tree_pair[0].forward_masked(tail + nodes, attend, positions, spec.num_nodes)
    chain_pair = twins(model, ids(gen, 9), layout)
    chain_new = ids(gen, 4)
    alone_chain = chain_pair[0].forward(chain_new, 5 - 1)
    tree_out, chain_out = forward_batch([
        ForwardRequest(tree_pair[1], tail + nodes, spec.num_nodes, attend=attend, positions=positions),
        ForwardRequest(chain_pair[1], chain_new, 4)])
    torch.testing.assert_close(alone_tree, tree_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(alone_chain, chain_out, atol=ATOL, rtol=0)
    assert_same_cache(*tree_pair)


def test_prefill_request_without_logits(model, layout):
    gen = torch.Generator().manual_seed(2)
    a, b = twins(model, [], layout)
    c, d = twins(model, ids(gen, 4), layout)
    prompt = ids(gen, 10)
    a.forward(prompt, 1)
    out = forward_batch([ForwardRequest(b, prompt, 0), ForwardRequest(d, ids(gen, 2), 1)])
    assert out[0].shape == (0, VOCAB) and out[1].shape == (1, VOCAB)
    assert_same_cache(a, b)


def test_batch_rejects_an_empty_request(model, layout):
    _, a = twins(model, [5], layout)
    _, b = twins(model, [6], layout)
    with pytest.raises(ValueError, match="at least one new token"):
        forward_batch([ForwardRequest(a, [7], 1), ForwardRequest(b, [], 1)])


def test_a_batch_of_one_token_rows_equals_alone(model, layout):
    """Edge-only sessions: every row one new token, at different cache lengths."""
    gen = torch.Generator().manual_seed(10)
    pairs = [twins(model, ids(gen, n), layout) for n in (1, 7, 3, 12, 5, 2)]
    news = [ids(gen, 1) for _ in pairs]
    alone = [a.forward(n, 1) for (a, _), n in zip(pairs, news)]
    batched = forward_batch([ForwardRequest(b, n, 1) for (_, b), n in zip(pairs, news)])
    for x, y in zip(alone, batched):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for a, b in pairs:
        assert_same_cache(a, b)


def test_a_reused_workspace_equals_alone(model):
    """One workspace through batches that grow and shrink (rows, cache lengths, new tokens): what a
    larger batch left in it is never seen by a smaller one."""
    gen = torch.Generator().manual_seed(11)
    workspace = BatchWorkspace()
    pairs = [twins(model, ids(gen, n)) for n in (9, 2, 14, 4)]
    for members, width in (((0, 1, 2, 3), 5), ((1, 3), 2), ((0, 2, 3), 7), ((1,), 3), ((3, 0), 1)):
        news = [ids(gen, max(1, width - i % 2)) for i in members]
        alone = [pairs[i][0].forward(n, len(n)) for i, n in zip(members, news)]
        batched = forward_batch([ForwardRequest(pairs[i][1], n, len(n)) for i, n in zip(members, news)],
                                workspace)
        for x, y in zip(alone, batched):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for a, b in pairs:
        assert_same_cache(a, b)


def test_a_half_failed_append_leaves_every_cache_as_before(model, monkeypatch):
    """The padded path appends each row's keys after the forward; if that fails halfway, the caches
    already appended to are cut back, so that running the requests again appends once."""
    from specdec.edge import batched

    gen = torch.Generator().manual_seed(12)
    pairs = [twins(model, ids(gen, n)) for n in (4, 6, 2)]
    before = [[(k.clone(), v.clone()) for k, v in kv(b)] for _, b in pairs]
    news = [ids(gen, 3) for _ in pairs]
    real_update = type(pairs[0][1].cache).update
    calls = {"n": 0}

    def failing_update(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # the second row's second layer: the first row has all its layers
            raise RuntimeError("out of memory")
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(type(pairs[0][1].cache), "update", failing_update)
    with pytest.raises(RuntimeError, match="out of memory"):
        forward_batch([ForwardRequest(b, n, 1) for (_, b), n in zip(pairs, news)])
    monkeypatch.setattr(type(pairs[0][1].cache), "update", real_update)
    for (_, b), old, prefix_len in zip(pairs, before, (4, 6, 2)):
        assert b.cache_len == prefix_len and all(layer.get_seq_length() == prefix_len for layer in b.cache.layers)
        for (k, v), (k0, v0) in zip(kv(b), old):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    again = forward_batch([ForwardRequest(b, n, 1) for (_, b), n in zip(pairs, news)])
    for (a, b), n, y in zip(pairs, news, again):
        torch.testing.assert_close(a.forward(n, 1), y, atol=ATOL, rtol=0)
        assert_same_cache(a, b)


def test_a_forward_failing_inside_the_model_leaves_the_caches_as_before(model, layout):
    """A forward that fails in a middle layer (after the first layers wrote their keys): every
    session's cache still holds exactly its prefix, and the next forward continues from there."""
    gen = torch.Generator().manual_seed(13)
    pairs = [twins(model, ids(gen, n), layout) for n in (3, 8)]
    news = [ids(gen, 2) for _ in pairs]

    def boom(*_):
        raise RuntimeError("device error")

    handle = model.model.model.layers[1].register_forward_pre_hook(boom)
    try:
        for requests in ([ForwardRequest(pairs[0][1], news[0], 2)],
                         [ForwardRequest(b, n, 2) for (_, b), n in zip(pairs, news)]):
            with pytest.raises(RuntimeError, match="device error"):
                forward_batch(requests)
    finally:
        handle.remove()
    for (a, b), n in zip(pairs, news):
        assert b.cache_len == a.cache_len
        torch.testing.assert_close(a.forward(n, 2), b.forward(n, 2), atol=ATOL, rtol=0)
        assert_same_cache(a, b)


# ------------------------------------------------------------------------------------- KV slots
def test_slots_read_a_span_with_gaps_or_gather_a_sparse_batch(model):
    """Sessions of a batch spread over the pool's rows: those between them (not in the batch) are
    read in place and left unchanged; a batch spread thinly is gathered. Both equal alone."""
    gen = torch.Generator().manual_seed(14)
    pool = SlotPool(model.model, model.device)
    pairs = [twins(model, ids(gen, 2 + i % 5), pool.new_lm) for i in range(12)]
    for members in ((0, 2, 5), (1, 11), (3, 4, 5, 6, 8), (11,), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)):
        news = [ids(gen, 1 + i % 3) for i in members]
        alone = [pairs[i][0].forward(n, len(n)) for i, n in zip(members, news)]
        batched = forward_batch([ForwardRequest(pairs[i][1], n, len(n)) for i, n in zip(members, news)])
        for x, y in zip(alone, batched):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for a, b in pairs:
        assert_same_cache(a, b)


def test_slots_roll_back_compact_a_tree_path_and_grow(model):
    gen = torch.Generator().manual_seed(15)
    pool = SlotPool(model.model, model.device)
    a, b = twins(model, ids(gen, 6), pool.new_lm)
    others = [twins(model, ids(gen, 3), pool.new_lm) for _ in range(5)]  # more rows than the first allocation
    for lm in (a, b):
        lm.forward(ids(torch.Generator().manual_seed(1), 5), 1)
        lm.truncate(8)
        lm.keep([0, 1, 2, 3, 5, 7])
    assert_same_cache(a, b)
    long_prompt = ids(gen, 300)  # past the first column allocation (CONTEXT_STEP)
    torch.testing.assert_close(a.forward(long_prompt, 3), b.forward(long_prompt, 3), atol=ATOL, rtol=0)
    assert_same_cache(a, b)
    for x, y in others:  # rows regrown under them kept their caches
        assert_same_cache(x, y)
    with pytest.raises(ValueError, match="truncate"):
        b.truncate(b.cache_len + 1)


@pytest.fixture
def static_keys(monkeypatch) -> list[tuple[int, int, int]]:
    """The (rows, columns, width) of every static forward run while the test runs."""
    from specdec.edge.slots import SlotPool as Pool

    keys: list[tuple[int, int, int]] = []
    real_call = Pool._static_call
    monkeypatch.setattr(Pool, "_static_call",
                        lambda self, key, inputs: keys.append(key) or real_call(self, key, inputs))
    return keys


def test_static_forwards_equal_alone_over_rounds_with_rollbacks_idle_rows_and_freed_rows(model, static_keys):
    """The static shapes a CUDA graph replays (edge/slots.py), run eagerly: rows bucketed to a power of
    two, right-padded tokens, every storage column, sessions outside the batch and a freed row inside
    the rows read. Over rounds of drafts with rollbacks (a verdict keeps a prefix of each round), each
    session's logits and cache equal its own alone; those outside a round's batch are untouched."""
    from specdec.edge.slots import STATIC_MAX_WIDTH

    widths = static_keys
    gen = torch.Generator().manual_seed(17)
    pool = SlotPool(model.model, model.device, static="eager")
    pairs = [twins(model, ids(gen, 2 + 3 * i), pool.new_lm) for i in range(7)]
    pairs[4][1].release()  # a free row below the highest: read, written beyond nothing, dropped
    live = [p for i, p in enumerate(pairs) if i != 4]
    widths.clear()  # the twins' prefixes ran static too, on fewer rows
    for step in range(12):
        members = [i for i in range(len(live)) if torch.rand((), generator=gen) < 0.6] or [step % len(live)]
        news = [ids(gen, 1 + int(torch.randint(0, 6, (), generator=gen))) for _ in members]
        before = {i: [(k.clone(), v.clone()) for k, v in kv(live[i][1])] for i in range(len(live)) if i not in members}
        alone = [live[i][0].forward(n, len(n)) for i, n in zip(members, news)]
        batched = forward_batch([ForwardRequest(live[i][1], n, len(n)) for i, n in zip(members, news)])
        for x, y in zip(alone, batched):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
        for i, n in zip(members, news):  # the verdict: keep the cache up to a prefix of the round
            keep = live[i][0].cache_len - int(torch.randint(0, len(n) + 1, (), generator=gen))
            for lm in live[i]:
                lm.truncate(keep)
        for i, old in before.items():
            for (k, v), (k0, v0) in zip(kv(live[i][1]), old):
                assert torch.equal(k, k0) and torch.equal(v, v0)
    for a, b in live:
        assert_same_cache(a, b)
    assert len(widths) == 12 and all(width <= STATIC_MAX_WIDTH for _, _, width in widths)
    assert {rows for rows, _, _ in widths} <= {4, 8}  # slots 0..6 in use: rows 0..3 or 0..7


def test_static_shapes_leave_trees_and_prefill_chunks_to_the_dynamic_plan(model, static_keys):
    from specdec.edge.slots import STATIC_MAX_WIDTH

    calls = static_keys
    gen = torch.Generator().manual_seed(18)
    pool = SlotPool(model.model, model.device, static="eager")
    a, b = twins(model, ids(gen, 4), pool.new_lm)  # the pool's first forward: dynamic (no storage yet)
    long = ids(gen, STATIC_MAX_WIDTH + 1)
    torch.testing.assert_close(a.forward(long, 2), b.forward(long, 2), atol=ATOL, rtol=0)
    spec = TreeSpec.from_config((2, 2))
    attend, positions = edge_tree_inputs(spec, a.cache_len, 1)
    nodes = ids(gen, spec.num_nodes)
    torch.testing.assert_close(a.forward_masked(nodes, attend, positions, spec.num_nodes),
                               b.forward_masked(nodes, attend, positions, spec.num_nodes), atol=ATOL, rtol=0)
    assert calls == []
    chain = ids(gen, 3)
    torch.testing.assert_close(a.forward(chain, 3), b.forward(chain, 3), atol=ATOL, rtol=0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SlotPool(model.model, torch.device("cpu"), static="graphs")


def test_a_released_slot_is_reused_from_empty_and_an_ended_session_cannot_forward(model):
    gen = torch.Generator().manual_seed(16)
    pool = SlotPool(model.model, model.device)
    first = pool.new_lm()
    first.forward(ids(gen, 9), 1)
    first.release()
    with pytest.raises(ValueError, match="ended"):
        first.forward([3], 1)
    a, b = twins(model, ids(gen, 4), pool.new_lm)
    assert b.slot == first.slot and b.cache_len == 4
    assert_same_cache(a, b)
    assert pool.rows_in_use == 1
    del a, b
    import gc
    gc.collect()
    assert pool.rows_in_use == 0  # a session dropped without release() gives its row back


# ------------------------------------------------------------------------------------- scheduler
@pytest.fixture(params=["off", "on"])
def overlap(request) -> str:
    """The scheduler verifies a forward's rounds before the next forward (off, a CPU's default) or
    on a thread of their own while the next one runs (on, CUDA's default): the same answers."""
    return request.param


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


def four_twins(model, gen: torch.Generator) -> tuple[list, list[list[int]]]:
    """Four sessions holding prefixes of 3-6 tokens, each with its twin that runs alone, and 2-5 new
    tokens for each."""
    return [twins(model, ids(gen, 3 + i)) for i in range(4)], [ids(gen, 2 + i) for i in range(4)]


def test_scheduler_runs_ready_sessions_in_one_forward(model, overlap):
    gen = torch.Generator().manual_seed(3)
    stats = []
    # A long window: the forward must start because all four handed in, not because time ran out.
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0, verify_overlap=overlap), observer=stats.append)
    try:
        pairs, news = four_twins(model, gen)
        out = run_threads(scheduler, [lambda b=b, n=n: scheduler.forward(ForwardRequest(b, n, len(n)))
                                      for (_, b), n in zip(pairs, news)])
    finally:
        scheduler.stop()
    assert [s.sessions for s in stats] == [4]
    assert stats[0].tokens == sum(len(n) for n in news)
    for (a, _), n, y in zip(pairs, news, out):
        torch.testing.assert_close(a.forward(n, len(n)), y, atol=ATOL, rtol=0)


def test_scheduler_caps_tokens_oldest_first_and_chunks_long_prompts(model, overlap):
    gen = torch.Generator().manual_seed(4)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(max_batch_tokens=8, wait_s=0.0, verify_overlap=overlap),
                                 observer=stats.append)
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


def test_a_failing_request_fails_only_its_own_session(model, overlap):
    gen = torch.Generator().manual_seed(6)
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0, verify_overlap=overlap))
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


def _round(draft: list[int], gen: torch.Generator, noise=None) -> ChainRound:
    """A gumbel round at T = 1 over the tiny vocabulary (its noise keyed by the generator's draws)."""
    rows = [torch.rand(VOCAB, generator=gen, dtype=torch.float64) + 0.01 for _ in range(len(draft) + 1)]
    return gumbel_round(torch.tensor(draft), TargetLaw(1.0), noise or (lambda i: rows[i]))


def test_the_rounds_of_a_forward_are_verified_together_as_each_alone(model, overlap):
    gen = torch.Generator().manual_seed(8)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0, verify_overlap=overlap), observer=stats.append)
    try:
        pairs, drafts = four_twins(model, gen)
        rounds = [_round(d, gen) for d in drafts]
        # what the edge feeds: the last verified token (the cache is one behind), then the drafts
        out = run_threads(scheduler, [lambda b=b, d=d, r=r: scheduler.verify(ForwardRequest(b, [1, *d], len(d) + 1), r)
                                      for (_, b), d, r in zip(pairs, drafts, rounds)])
    finally:
        scheduler.stop()
    assert [(s.sessions, s.rounds) for s in stats] == [(4, 4)] and stats[0].verify_seconds > 0
    for (a, _), d, r, o in zip(pairs, drafts, rounds, out):
        assert o == verify_alone(ForwardRequest(a, [1, *d], len(d) + 1), r)


def test_a_round_failing_verification_fails_only_its_own_session(model, overlap):
    gen = torch.Generator().manual_seed(9)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0, verify_overlap=overlap), observer=stats.append)
    try:
        (ref, good), (_, bad) = twins(model, ids(gen, 3)), twins(model, ids(gen, 3))
        draft = ids(gen, 2)
        fine = _round(draft, gen)
        broken = _round(ids(gen, 2), gen, noise=lambda i: -torch.ones(VOCAB, dtype=torch.float64))
        out = run_threads(scheduler, [lambda: scheduler.verify(ForwardRequest(good, [1, *draft], 3), fine),
                                      lambda: scheduler.verify(ForwardRequest(bad, [1, *ids(gen, 2)], 3), broken)])
    finally:
        scheduler.stop()
    assert [s.sessions for s in stats] == [2]  # one forward: the failure came after it
    assert isinstance(out[1], ValueError) and "positive float64" in str(out[1])
    assert out[0] == verify_alone(ForwardRequest(ref, [1, *draft], 3), fine)


def test_with_overlap_the_next_forward_runs_while_a_forward_s_rounds_are_verified(model, overlap):
    """Session A's round is held in verification (its race noise waits for a signal); session B hands
    in a forward meanwhile. With overlap B's forward runs while A's round is still being verified
    (its answer follows A's verdict: forwards are answered in order), and without waiting for A,
    which cannot hand in before its verdict (a 30 s batch window would hold it otherwise); without
    overlap (the control) B's forward waits for A's verification to end."""
    gen = torch.Generator().manual_seed(10)
    scheduler = ForwardScheduler(BatchSettings(wait_s=30.0, verify_overlap=overlap))
    (ref_a, a), (ref_b, b) = twins(model, ids(gen, 3)), twins(model, ids(gen, 4))
    draft, news = ids(gen, 2), ids(gen, 2)
    rows = [torch.rand(VOCAB, generator=gen, dtype=torch.float64) + 0.01 for _ in range(len(draft) + 1)]
    verifying, release = threading.Event(), threading.Event()

    def held(i):
        verifying.set()
        release.wait(timeout=30)
        return rows[i]

    out: dict = {}

    def session(name, work):
        with scheduler.working():
            out[name] = work()

    sa = threading.Thread(target=session, args=("a", lambda: scheduler.verify(
        ForwardRequest(a, [1, *draft], 3), gumbel_round(torch.tensor(draft), TargetLaw(1.0), held))))
    sb = threading.Thread(target=session, args=("b", lambda: scheduler.forward(ForwardRequest(b, news, 1))))
    try:
        sa.start()
        assert verifying.wait(timeout=30)
        sb.start()
        deadline = time.perf_counter() + 2.0
        while b.cache_len == 4 and time.perf_counter() < deadline:
            time.sleep(0.01)
        ran_while_held = b.cache_len == 4 + len(news)
        release.set()
        sa.join(timeout=30)
        sb.join(timeout=30)
    finally:
        release.set()
        scheduler.stop()
    assert ran_while_held == (overlap == "on")
    torch.testing.assert_close(ref_b.forward(news, 1), out["b"], atol=ATOL, rtol=0)
    alone = gumbel_round(torch.tensor(draft), TargetLaw(1.0), lambda i: rows[i])
    assert out["a"] == verify_alone(ForwardRequest(ref_a, [1, *draft], 3), alone)


def test_verification_overlaps_the_next_forward_where_the_forward_leaves_the_host_idle() -> None:
    assert BatchSettings().resolved("cpu").verify_overlap == "off"
    assert BatchSettings().resolved("cuda").verify_overlap == "on"
    assert BatchSettings(enabled=False).resolved("cuda").verify_overlap == "off"
    assert BatchSettings(verify_overlap="on").resolved("cpu").verify_overlap == "on"
    assert BatchSettings(verify_overlap="off").resolved("cuda").verify_overlap == "off"
    with pytest.raises(ValueError, match="needs batching"):
        BatchSettings(enabled=False, verify_overlap="on").resolved("cpu")
    with pytest.raises(ValueError, match="verify_overlap must be one of"):
        BatchSettings(verify_overlap="yes").resolved("cpu")


def test_stopped_scheduler_refuses_work(model, overlap):
    scheduler = ForwardScheduler(BatchSettings(verify_overlap=overlap))
    scheduler.stop()
    lm, _ = twins(model, [3])
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.forward(ForwardRequest(lm, [4], 1))


def test_sessions_due_back_are_waited_for_so_they_do_not_fall_into_lockstep(model, overlap):
    """Two sessions whose gap between forwards (20 ms: round trip and drafting) is shorter than a
    forward: without waiting for the one due back, each forward would serve one of them while the
    other waits. With the join window they share forwards once the scheduler has seen their gaps."""
    gen = torch.Generator().manual_seed(7)
    stats = []
    scheduler = ForwardScheduler(BatchSettings(wait_s=0.0, verify_overlap=overlap), observer=stats.append)
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


def test_the_edge_counts_static_forwards_and_cuda_graph_replays_by_outcome() -> None:
    """The metrics a GPU edge's forwards feed (a CPU never captures a graph, so the labels are fed here
    by hand): static shapes counted, graph forwards by whether their capture came first or failed."""
    from specdec.edge.batching import BatchStats
    from specdec.edge.metrics import EdgeMetrics

    metrics = EdgeMetrics()
    for static, graph in ((False, ""), (True, ""), (True, "captured"), (True, "replayed"), (True, "replayed"),
                          (True, "failed")):
        metrics.observe_batch(BatchStats(sessions=2, tokens=6, queue_seconds=(0.0, 0.0), forward_seconds=0.01,
                                         static=static, graph=graph))
    samples = {(s.name, s.labels.get("graph")): s.value
               for m in (metrics.batch_static, metrics.batch_graphs) for m_ in m.collect() for s in m_.samples
               if s.name.endswith("_total")}
    assert samples == {("specdec_edge_batch_static_forwards_total", None): 5,
                       ("specdec_edge_batch_cuda_graph_forwards_total", "captured"): 1,
                       ("specdec_edge_batch_cuda_graph_forwards_total", "replayed"): 2,
                       ("specdec_edge_batch_cuda_graph_forwards_total", "failed"): 1}
