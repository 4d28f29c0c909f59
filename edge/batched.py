"""One target forward over the new tokens of several sequences, each with its own KV cache.

Model code, not transport: it runs forwards and never imports grpc. The edge's scheduler
(:mod:`specdec.edge.batching`) gathers the sessions' requests and calls :func:`forward_batch`.

Layout ("padding with attention masks"): the B cached prefixes are copied right-padded into one
[B, heads, C, head_dim] cache per layer, C the longest; the new tokens are left-padded into
[B, N] so that every row's last logits sit at the same positions (one ``logits_to_keep`` for all).
A 4-D boolean mask lets row b's query i see its own c_b cached keys and its own new keys up to i
(or the tree pattern it asked for); padded keys are never seen, and a padded query sees only
itself (an all-false row would make sdpa return NaN). Each row's new keys and values are appended
to its own cache afterwards, so a session's cache is the same object with or without batching.

Two layouts of the sessions' caches:

- per-session caches (:class:`~specdec.common.modeling.CachedLM`, this module's padded path): each
  session holds its own growing cache, and a batched forward copies them into one padded cache. On
  a CPU the copy costs far less than the forward reads in weights (135M float32 parameters: ~540 MB
  per forward; 8 sessions x 300 cached tokens of SmolLM2's KV: ~110 MB) and memory follows each
  session's length;
- KV slots (:mod:`specdec.edge.slots`): one preallocated cache with a row per session, written in
  place and read through masks, no copy per forward; what a GPU needs, where a forward reads its
  weights in milliseconds and thousands of per-session copies would cost more than the forward.

A failed forward leaves every cache as it was before it (a half-appended one is cut back), so a
scheduler may rerun its requests one by one.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.common.modeling import CachedLM, cache_kwargs


@dataclass
class ForwardRequest:
    """One sequence's share of a forward: feed ``new_ids`` after its cached prefix."""
    lm: CachedLM                          # its model runner and KV cache (appended to in place)
    new_ids: list[int]
    num_logits: int                       # logits of the last inputs to return (0 = none: a prefill chunk)
    attend: torch.Tensor | None = None    # [n, cache_len + n] bool (token trees); None = causal
    positions: torch.Tensor | None = None  # [n] int64 position ids (trees); None = cache_len + i

    @property
    def num_tokens(self) -> int:
        return len(self.new_ids)


def batchable(lm) -> bool:
    """Whether ``lm`` can share a forward with others: KV slots always, per-session caches only of
    plain full-attention layers, which can be padded and sliced (no sliding windows)."""
    if getattr(lm, "pool", None) is not None:
        return True
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in lm.cache.layers)


def batch_key(lm) -> object:
    """Requests share a forward only with requests of the same key: one KV slot pool, or per-session
    caches (None)."""
    return getattr(lm, "pool", None)


class PhaseTimer:
    """Seconds per phase of forwards (inputs, copy, forward, append, logits), for profiling a batched
    round (the GPU check). ``sync`` waits for the device before each mark: its queued work would
    otherwise land in whichever phase next reads a result."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        if self.sync is not None:
            self.sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def _mark(timer: PhaseTimer | None, phase: str) -> None:
    if timer is not None:
        timer.mark(phase)


@torch.inference_mode()
def forward_batch(requests: list[ForwardRequest], workspace: BatchWorkspace | None = None,
                  timer: PhaseTimer | None = None) -> list[torch.Tensor]:
    """Run all ``requests`` in one forward of their shared model; row b's [num_logits_b, V] float32
    logits, equal to what ``lm.forward`` / ``lm.forward_masked`` would return within float
    tolerance (a single per-session request takes exactly that path). ``workspace``: memory to reuse
    across calls (a scheduler keeps one). If the forward fails, every cache is as it was before."""
    if not requests:
        return []
    if any(not r.new_ids for r in requests):
        raise ValueError("forward needs at least one new token")
    pool = batch_key(requests[0].lm)
    if pool is not None:
        return pool.forward(requests, timer)
    if any(batch_key(r.lm) is not None for r in requests):
        raise ValueError("a batch does not mix KV slots with per-session caches")
    if timer is not None:
        timer.start()
    with _restored_on_error(requests):
        if len(requests) == 1:
            out = [_forward_one(requests[0])]
            _mark(timer, "forward")
            return out
        return _forward_padded(requests, workspace or BatchWorkspace(), timer)


@contextmanager
def _restored_on_error(requests: list[ForwardRequest]) -> Iterator[None]:
    """Cut every cache back to its length before the forward if it fails: a forward appends layer by
    layer, so one that fails halfway leaves some layers of some caches longer than the others, and a
    rerun would append twice."""
    lens = [r.lm.cache_len for r in requests]
    try:
        yield
    except BaseException:
        for r, n in zip(requests, lens):
            _cut_back(r.lm, n)
        raise


def _cut_back(lm: CachedLM, length: int) -> None:
    for layer in lm.cache.layers:
        extra = layer.get_seq_length() - length if getattr(layer, "is_initialized", True) else 0
        if extra > 0:
            layer.crop(-extra)  # a negative argument removes that many tokens in every version


def _forward_padded(requests: list[ForwardRequest], workspace: BatchWorkspace,
                    timer: PhaseTimer | None) -> list[torch.Tensor]:
    model, device = requests[0].lm.model, requests[0].lm.device
    if any(r.lm.model is not model for r in requests):
        raise ValueError("a batch shares one model")
    lens = [r.lm.cache_len for r in requests]
    width = max(r.num_tokens for r in requests)
    ids, positions = _padded_inputs(requests, lens, width, device)
    mask = _batch_mask(requests, lens, width).to(device)
    _mark(timer, "inputs")
    past = _padded_past(requests, lens, width, workspace)
    _mark(timer, "copy")
    keep = max(1, max(r.num_logits for r in requests))
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None], use_cache=True,
                logits_to_keep=keep, **cache_kwargs(model, past))
    _mark(timer, "forward")
    _append_new_kv(requests, past)
    _mark(timer, "append")
    logits = out.logits.float()
    _mark(timer, "logits")
    return [logits[b, keep - r.num_logits:] for b, r in enumerate(requests)]


def _forward_one(r: ForwardRequest) -> torch.Tensor:
    keep = max(1, r.num_logits)
    if r.attend is None:
        logits = r.lm.forward(r.new_ids, num_logits=keep)
    else:
        logits = r.lm.forward_masked(r.new_ids, r.attend, r.positions, keep)
    return logits[keep - r.num_logits:]


class BatchWorkspace:
    """Memory the padded caches of successive batches reuse, one flat buffer per layer for keys and one
    for values, grown as batches grow (never shrunk). Fresh buffers of ~100 MB per forward cost more
    in page faults than the copies into them; a reused one holds only finite old keys, which the
    masks hide (an all-finite key times a zero weight adds nothing, where uninitialized memory might
    hold NaN)."""

    def __init__(self):
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def view(self, layer_idx: int, kind: str, like: torch.Tensor, shape: list[int]) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get((layer_idx, kind))
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.zeros(numel * 5 // 4, dtype=like.dtype, device=like.device)  # headroom: rows grow
            self._buffers[(layer_idx, kind)] = buf
        return buf[:numel].view(shape)


def _batch_layer_class():
    from transformers.cache_utils import DynamicLayer

    class BatchLayer(DynamicLayer):
        """One layer of a batch's padded cache: [B, H, C + N, D] whose first C columns hold the rows'
        cached keys; the forward writes the N new columns in place (DynamicLayer would cat: a
        second copy of every cache)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
            super().__init__()
            self.keys, self.values, self.filled = keys, values, filled
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.filled + key_states.shape[-2]
            self.keys[:, :, self.filled:end] = key_states
            self.values[:, :, self.filled:end] = value_states
            self.filled = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_seq_length(self) -> int:
            return self.filled

    return BatchLayer


def _padded_past(requests: list[ForwardRequest], lens: list[int], width: int, workspace: BatchWorkspace):
    """A cache of [B, H, C + N, D] per layer: row b's cached keys/values in its first c_b columns,
    room for the N new ones at C."""
    from transformers.cache_utils import Cache

    longest = max(lens)
    first = next((r for r, n in zip(requests, lens) if n), None)
    if first is None:  # nothing cached anywhere (first prefill chunks): a plain growing cache
        from transformers import DynamicCache
        return DynamicCache()
    layer_class = _batch_layer_class()
    layers = []
    for layer_idx, layer in enumerate(first.lm.cache.layers):
        shape = list(layer.keys.shape)
        shape[0], shape[-2] = len(requests), longest + width
        keys = workspace.view(layer_idx, "k", layer.keys, shape)
        values = workspace.view(layer_idx, "v", layer.values, shape)
        for b, (r, n) in enumerate(zip(requests, lens)):
            if n:
                src = r.lm.cache.layers[layer_idx]
                keys[b, :, :n] = src.keys[0]
                values[b, :, :n] = src.values[0]
        layers.append(layer_class(keys, values, longest))
    return Cache(layers=layers)


def _padded_inputs(requests: list[ForwardRequest], lens: list[int], width: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N] input ids (left-padded with token 0) and position ids (padding repeats a real one)."""
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    positions = torch.zeros(len(requests), width, dtype=torch.long)
    for b, (r, n) in enumerate(zip(requests, lens)):
        k = r.num_tokens
        ids[b, width - k:] = torch.tensor(r.new_ids, dtype=torch.long)
        own = r.positions.cpu() if r.positions is not None else torch.arange(n, n + k)
        positions[b, width - k:] = own
        positions[b, :width - k] = own[0]
    return ids.to(device), positions.to(device)


def _batch_mask(requests: list[ForwardRequest], lens: list[int], width: int) -> torch.Tensor:
    """[B, N, C + N] bool: which keys each (left-padded) query may see."""
    longest = max(lens)
    mask = torch.zeros(len(requests), width, longest + width, dtype=torch.bool)
    diag = torch.arange(width)
    mask[:, diag, longest + diag] = True  # every query sees itself: padded ones see nothing else
    for b, (r, n) in enumerate(zip(requests, lens)):
        k = r.num_tokens
        attend = r.attend.cpu() if r.attend is not None else _causal(n, k)
        if attend.shape != (k, n + k):
            raise ValueError(f"attend {tuple(attend.shape)} does not fit {k} new tokens after {n} cached")
        rows = slice(width - k, width)
        mask[b, rows, :n] = attend[:, :n]
        mask[b, rows, longest + width - k:] = attend[:, n:]
    return mask


def _causal(cached: int, new: int) -> torch.Tensor:
    """[new, cached + new]: all of the prefix, and the new tokens up to oneself."""
    return torch.ones(new, cached + new, dtype=torch.bool).tril(cached)


def _append_new_kv(requests: list[ForwardRequest], past) -> None:
    """Append each row's new keys/values (the last n_b of the batch's N new columns) to its cache."""
    for layer_idx, layer in enumerate(past.layers):
        for b, r in enumerate(requests):
            k = r.num_tokens
            new_k = layer.keys[b:b + 1, :, layer.keys.shape[-2] - k:]
            new_v = layer.values[b:b + 1, :, layer.values.shape[-2] - k:]
            r.lm.cache.update(new_k, new_v, layer_idx)  # cat copies them out
