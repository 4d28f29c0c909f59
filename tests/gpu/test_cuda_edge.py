"""The edge on a CUDA device: every mode's greedy identity in float32 and bfloat16, the target law,
batched = unbatched with both KV layouts, resume on a fresh edge, and the drafter on the GPU.

Real gRPC on loopback, tiny real checkpoints loaded through the product's loader onto the device.
"The target alone" is transformers' own greedy ``generate`` of the same checkpoint on the same device
in the same dtype.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from functools import lru_cache

import pytest
import torch

from specdec.edge.batched import ForwardRequest, forward_batch
from specdec.common.modeling import CachedLM, LoadedModel, ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.common.modes import Mode
from specdec.edge.slots import CONTEXT_STEP, SlotPool
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import edge_tree_inputs
from specdec.device.client import ConnectionPolicy, generate
from specdec.device.factory import open_channel
from specdec.device.session import DraftSession
from specdec.edge.batching import BatchSettings, ForwardScheduler
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.verifier import EdgeLimits
from tests.support.laws import N_TOKENS, PROMPT, TEMPERATURE, exact_law
from tests.support.harness import device_config, load, run_sessions
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

PROMPTS = ["w1 w2 w3", "w40 w7", "w300 w301 w302 w303 w9"]
MAX_NEW = 16
DTYPES = ["float32", "bfloat16"]
MODES = {  # every mode, each compressing on a 512-token vocabulary, and a token tree
    "dense": dict(mode="dense", dense_dtype="fp16"),
    "tslt": dict(mode="tslt", top_k=16),
    "ksqs": dict(mode="ksqs", top_k=16, lattice=64),
    "csqs": dict(mode="csqs", csqs_beta0=0.01, lattice=64, max_k=64),
    "dssd": dict(mode="dssd", dssd_samples=2),
    "none": dict(mode="none"),
    "tree": dict(mode="tslt", top_k=16, tree=(2, 2)),
}
LAW_SESSIONS = 800   # the check's budget: ~10-20 s on a GPU; the CPU suite runs 1000-1500 per mode
LAW_CONCURRENCY = 8


@lru_cache(maxsize=8)
def on_device(path: str, device: str, dtype: str) -> LoadedModel:
    return load_model(ModelSpec(model=path, device=device, dtype=dtype))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def device_edge(target_dir, device: str, dtype: str = "float32", port: int = 0,
                      metrics: EdgeMetrics | None = None, **cfg_kw):
    """A real grpc.aio edge in this loop, its target on ``device`` in ``dtype`` (batching on: KV
    slots on CUDA by default)."""
    target = on_device(str(target_dir), device, dtype)
    cfg = EdgeConfig(model=ModelSpec(model=str(target_dir), device=device, dtype=dtype), host="127.0.0.1",
                     port=port, workers=4, **{"limits": EdgeLimits(), **cfg_kw})
    server, bound = await start_server(cfg, target, metrics)
    try:
        yield f"127.0.0.1:{bound}"
    finally:
        await stop_server(server, grace=0)


def target_alone(target_dir, device: str, dtype: str, prompt_ids: list[int], max_new: int) -> list[int]:
    m = on_device(str(target_dir), device, dtype)
    ids = torch.tensor([prompt_ids], device=m.device)
    out = m.model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                           eos_token_id=list(m.eos_token_ids))
    return out[0, len(prompt_ids):].tolist()


def prompt_ids(drafter_dir, prompt: str) -> list[int]:
    return encode_prompt(load(str(drafter_dir)).tokenizer, prompt, raw=True)


# ----------------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_mode_at_once_equals_the_target_alone(close_pair, margin_pair, device, dtype) -> None:
    """All modes' sessions in flight together on one edge (their forwards batched), each the target's
    own greedy decode on the same device and dtype; drafts were accepted, so the accept and rollback
    paths ran. bfloat16 uses a target without near ties (conftest.margin_pair)."""
    target_dir, drafter_dir = close_pair if dtype == "float32" else margin_pair
    metrics = EdgeMetrics()

    async def main():
        async with device_edge(target_dir, device, dtype, metrics=metrics) as address:
            jobs = [run_sessions(address, drafter_dir, device_config(temperature=0.0, max_new_tokens=MAX_NEW, **kw),
                                 prompt, [0]) for kw in MODES.values() for prompt in PROMPTS]
            return await asyncio.gather(*jobs)

    results = iter(asyncio.run(main()))
    for name in MODES:
        for prompt in PROMPTS:
            [(tokens, _, session)] = next(results)
            expected = target_alone(target_dir, device, dtype, prompt_ids(drafter_dir, prompt), MAX_NEW)
            assert tokens == expected, f"{name} {dtype} prompt {prompt!r}"
            if name != "none":
                assert session.stats.accepted_tokens > 0, f"{name}: no draft accepted"


@pytest.mark.parametrize("kv_cache", ["per-session", "slots", "slots-graphs"])
def test_no_batching_and_both_kv_layouts_equal_the_target_alone(close_pair, device, kv_cache) -> None:
    """slots-graphs: the chain forwards replayed from CUDA graphs (the CUDA default), slots: launched."""
    _graphs_need_cuda(kv_cache, device)
    target_dir, drafter_dir = close_pair
    batching = BatchSettings(kv_cache=kv_cache.removesuffix("-graphs"),
                             cuda_graphs="on" if kv_cache.endswith("graphs") else "off")

    async def main():
        out = {}
        for label, kw in (("batched", dict(batching=batching)), ("alone", dict(batching=BatchSettings(enabled=False)))):
            async with device_edge(target_dir, device, **kw) as address:
                cfg = device_config(temperature=0.0, max_new_tokens=MAX_NEW, **MODES["tslt"])
                out[label] = await asyncio.gather(*(run_sessions(address, drafter_dir, cfg, p, [0]) for p in PROMPTS))
        return out

    out = asyncio.run(main())
    for label, results in out.items():
        for prompt, [(tokens, _, _)] in zip(PROMPTS, results):
            assert tokens == target_alone(target_dir, device, "float32", prompt_ids(drafter_dir, prompt), MAX_NEW), \
                (label, kv_cache, prompt)


# ------------------------------------------------------------------------------------------- the law
def test_the_target_law_holds_on_the_device(tiny_pair_v8, device) -> None:
    """T = 1, chains with the coupled bonus, eight sessions in flight: the output law is the target's
    (chi-square against the exact law, enumerated on the CPU; the device's p differs by rounding)."""
    target_dir, drafter_dir = tiny_pair_v8
    metrics = EdgeMetrics()
    cfg = device_config(temperature=TEMPERATURE, max_new_tokens=N_TOKENS, draft_len=2, mode="tslt", top_k=3)

    async def main():
        async with device_edge(target_dir, device, metrics=metrics) as address:
            return await run_sessions(address, drafter_dir, cfg, PROMPT, range(LAW_SESSIONS),
                                      concurrency=LAW_CONCURRENCY)

    counts = Counter(tuple(tokens) for tokens, _, _ in asyncio.run(main()))
    law = exact_law(str(target_dir), tuple(prompt_ids(drafter_dir, PROMPT)))
    assert set(counts) <= set(law), "generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"{device}: {LAW_SESSIONS} sessions: {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


# ------------------------------------------------------------------------------ batched = unbatched
def _alone_and_batched(model: LoadedModel, make_lm):
    """Pairs of runners with the same prefixes: one runs alone (its own cache), one in batches."""
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(2, model.vocab_size, (n,), generator=gen).tolist()

    pairs = []
    for n in (5, 1, 12, 0, 3, 30):
        pair, prefix = (CachedLM(model.model, model.device), make_lm()), ids(n)
        for lm in pair:
            if n:
                lm.forward(prefix, 1)
        pairs.append(pair)
    return pairs, ids


@pytest.mark.parametrize("kv_cache", ["per-session", "slots", "slots-graphs"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_forwards_equal_unbatched(close_pair, device, dtype, kv_cache) -> None:
    """Chains, a tree, one-token rows (edge-only) and a prompt in prefill chunks through the scheduler:
    each the same logits as its session alone (float32: to 1e-4; bfloat16: the same argmax where the
    top two are apart, and logits to 3 % of their scale). slots-graphs: the chain forwards replayed
    from CUDA graphs, and each session's next token after them too."""
    _graphs_need_cuda(kv_cache, device)
    model = on_device(str(close_pair[0]), device, dtype)
    pool = None
    if kv_cache != "per-session":
        pool = SlotPool(model.model, model.device, static="graphs" if kv_cache == "slots-graphs" else "off")
    pairs, ids = _alone_and_batched(model, pool.new_lm if pool else lambda: CachedLM(model.model, model.device))
    spec = TreeSpec.from_config((2, 2))
    tree_nodes = ids(spec.num_nodes - 1)
    attend, positions = edge_tree_inputs(spec, pairs[0][0].cache_len, 1)
    requests = [  # (index of the pair, new ids, logits wanted, tree mask, tree positions)
        (0, ids(1) + tree_nodes, spec.num_nodes, attend, positions),
        (1, ids(5), 5, None, None), (2, ids(1), 1, None, None), (3, ids(1), 1, None, None),
        (4, ids(3), 2, None, None), (5, ids(40), 3, None, None)]  # 40 tokens: 3 chunks of 16
    scheduler = ForwardScheduler(BatchSettings(max_batch_tokens=16, wait_s=0.05), pool=pool, device=device)
    try:
        alone = [pairs[i][0].forward(new, k) if a is None else pairs[i][0].forward_masked(new, a, p, k)
                 for i, new, k, a, p in requests]

        async def batched():
            return await asyncio.gather(*(asyncio.to_thread(_in_session, scheduler, ForwardRequest(
                pairs[i][1], new, k, attend=a, positions=p)) for i, new, k, a, p in requests))

        got = asyncio.run(batched())
    finally:
        scheduler.stop()
    for x, y in zip(alone, got):
        _assert_close(x, y, dtype)
    for a, b in pairs:
        assert a.cache_len == b.cache_len
        _assert_close(a.forward([7], 1), b.forward([7], 1), dtype)
    if kv_cache == "slots-graphs":
        assert pool.graph_captures > 0 and any(g is not None for g in pool._graphs.values())


GROWN_PAST = CONTEXT_STEP + 44  # one-token forwards: past the first storage's columns, so the graphs are recaptured
# Logits of ~10 differ by ~1e-4 between kernels of different shapes in float32 (measured on an H200);
# a wrong mask or a misplaced key moves them by ~0.1 or more.
RECAPTURE_RTOL = 1e-4


def test_graphs_are_recaptured_after_the_storage_grows(close_pair, device) -> None:
    """Growing the slots' storage drops every graph; the next shapes are captured again (into a fresh
    memory pool: torch refuses to capture into one whose graphs are all gone) and replayed, with each
    session's logits those of the session alone. A pool handle kept across the drop fails every
    capture after it (graph_failures)."""
    _graphs_need_cuda("slots-graphs", device)
    model = on_device(str(close_pair[0]), device, "float32")
    pool = SlotPool(model.model, model.device, static="graphs")
    sessions = [(CachedLM(model.model, model.device), pool.new_lm()) for _ in range(2)]
    prompt = list(range(3, 23))  # 20 tokens: a dynamic first forward makes the storage
    tokens = []
    for alone, slot in sessions:
        x, y = alone.forward(prompt, 1), slot.forward(prompt, 1)
        torch.testing.assert_close(x, y, atol=1e-4, rtol=RECAPTURE_RTOL)
        tokens.append(int(x[-1].argmax()))
    for step in range(GROWN_PAST):
        for i, (alone, slot) in enumerate(sessions):
            if i and step % 2:
                continue  # the second session falls behind: rows of different lengths
            x, y = alone.forward([tokens[i]], 1), slot.forward([tokens[i]], 1)
            torch.testing.assert_close(x, y, atol=1e-4, rtol=RECAPTURE_RTOL)
            tokens[i] = int(x[-1].argmax())
    assert pool.keys[0].shape[2] > CONTEXT_STEP, "the storage never grew: the test checks nothing"
    assert pool.graph_failures == 0
    assert pool.graph_captures >= 2 and pool.graph_replays > GROWN_PAST


def _graphs_need_cuda(kv_cache: str, device: str) -> None:
    if kv_cache.endswith("graphs") and not device.startswith("cuda"):
        pytest.skip("CUDA graphs need a GPU (tests/unit/test_batching.py checks the static shapes they "
                    "replay on the CPU)")


def _in_session(scheduler: ForwardScheduler, request: ForwardRequest) -> torch.Tensor:
    with scheduler.working():
        return scheduler.forward(request)


def _assert_close(x: torch.Tensor, y: torch.Tensor, dtype: str) -> None:
    assert x.shape == y.shape and x.device == y.device
    if dtype == "float32":
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
        return
    scale = x.abs().max().item()
    assert (x - y).abs().max().item() <= 0.03 * scale
    top2 = x.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.06 * scale
    assert torch.equal(x.argmax(-1)[clear], y.argmax(-1)[clear])


# ------------------------------------------------------------------------------------------- resume
def test_a_session_resumes_on_a_fresh_edge(close_pair, device) -> None:
    """The edge is stopped mid-session (every session lost) and a fresh one starts on the same port:
    the device resumes, the new edge re-prefills its prefix on the device, the output is the target's."""
    target_dir, drafter_dir = close_pair
    port = free_port()
    drafter = load(str(drafter_dir))
    cfg = device_config(mode=Mode.TSLT, temperature=0.0, max_new_tokens=40, top_k=16)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    ids = prompt_ids(drafter_dir, PROMPTS[0])
    policy = ConnectionPolicy(round_timeout_s=10.0, reconnect_timeout_s=60.0, backoff_initial_s=0.1, backoff_max_s=0.5)

    async def main():
        edges = {}
        first = device_edge(target_dir, device, port=port)
        await first.__aenter__()
        seen = {"n": 0}

        async def replace_edge():
            await first.__aexit__(None, None, None)
            edges["second"] = device_edge(target_dir, device, port=port)
            await edges["second"].__aenter__()

        def on_tokens(new):
            seen["n"] += len(new)
            if seen["n"] >= 12 and "task" not in edges:
                edges["task"] = asyncio.get_running_loop().create_task(replace_edge())

        try:
            async with open_channel(f"127.0.0.1:{port}") as channel:
                return await generate(channel, DraftSession(drafter, hello), hello, ids, drafter.eos_token_ids,
                                      on_tokens=on_tokens, timeout=120, policy=policy)
        finally:
            if "second" in edges:
                await edges["second"].__aexit__(None, None, None)

    result = asyncio.run(main())
    assert result.reconnects >= 1
    assert result.token_ids == target_alone(target_dir, device, "float32", ids, 40)


# ------------------------------------------------------------------------------------------ drafter
def test_the_drafter_on_the_device(close_pair, device) -> None:
    """The device's drafter on the GPU (q computed and encoded from GPU tensors) against an edge on
    the same device: the target's greedy decode, with drafts accepted."""
    target_dir, drafter_dir = close_pair
    drafter = on_device(str(drafter_dir), device, "float32")

    async def main():
        async with device_edge(target_dir, device) as address:
            return await asyncio.gather(*(run_sessions(address, drafter, device_config(
                temperature=0.0, max_new_tokens=MAX_NEW, **MODES[name]), PROMPTS[0], [0])
                for name in ("tslt", "dssd", "tree")))

    for [(tokens, _, session)] in asyncio.run(main()):
        assert tokens == target_alone(target_dir, device, "float32", prompt_ids(drafter_dir, PROMPTS[0]), MAX_NEW)
        assert session.stats.accepted_tokens > 0
