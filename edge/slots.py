"""KV slots: one cache for all of an edge's sessions, a row (slot) per session, written in place.

Model code, not transport (it runs forwards; no grpc). The layout of static-cache engines (gpt-fast's
``KVCache``, transformers' ``StaticCache``): per layer one tensor [S, H, C, D] of keys and one of
values; session s owns row s and its first ``length`` columns. A forward over the new tokens of B
sessions (:meth:`SlotPool.forward`):

- writes each new key and value straight into its slot at its position (one indexed write per layer
  for the whole batch), and attends to a view of the rows the batch spans, with a mask per row:
  no session's cache is copied, where the per-session layout (:mod:`specdec.edge.batched`) copies
  every cache into a padded one and appends it back, thousands of small copies per forward on a
  large model;
- rows inside the span that are not in the batch are read but never change anything (their queries
  are zeros and their outputs dropped); a batch spread thinly over many rows is gathered instead
  (:data:`SPAN_FACTOR`), a copy of its own rows only;
- grouped-query attention runs on the key/value heads: each key/value head's query heads are folded
  into its query rows, so keys are never repeated per query head (transformers' ``repeat_kv`` copies
  all of them, per layer, whenever a mask is given);
- rollback (``truncate``) only moves a length; a tree's accepted path is compacted within its row.

A forward that fails leaves every session's length as it was: the keys it wrote lie beyond those
lengths, where no mask looks. Rows and columns grow on demand (columns in steps of
:data:`CONTEXT_STEP`, rows by doubling), one layer at a time; memory is kept once grown.

Static shapes and CUDA graphs (``static``): a GPU forward of a few tokens per session is bound by
its ~1,000 kernel launches, not by its arithmetic (gpu-check on an H200: an ~8B forward costs the
same 21-24 ms from 1 to 256 tokens; replayed from a CUDA graph, 8-11 ms). A graph replays fixed
shapes and addresses, so a chain batch can also run as one static forward: the rows ``0..R-1`` (R the
batch's highest slot + 1, rounded up to a power of two), every row ``W`` tokens wide, all the storage's
columns. Row r's tokens sit at positions ``start_r .. start_r + W - 1`` (its length; right-padded), its
keys at those columns, and its queries see the columns up to their position: for a session in the
batch exactly what the dynamic plan gives its real tokens; its pad tokens and every row outside the
batch write keys only beyond their row's length, which no mask reads (the slots' invariant), and
their outputs are dropped. The host only fills ``[2, R, W]`` ids and positions; everything else
(the write indices, the masks) is computed on the device from the positions, inside the graph. A
graph per (R, columns, W), captured at its first forward: that forward's own inputs warm it up (the
forward is idempotent: it writes the same keys where it reads them), then it is replayed; storage
regrowth drops them all (their addresses are gone). ``static="eager"`` runs the same static forward
without a graph: what the CPU tests check, since a graph captures exactly that code. Trees, explicit
positions and wider forwards (prefill chunks) keep the dynamic plan.

Only plain full-attention decoders fit (no sliding windows): :func:`slots_supported`.
"""
from __future__ import annotations

import heapq
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.common.modeling import cache_kwargs
from specdec.edge.batched import ForwardRequest, PhaseTimer

ATTENTION_NAME = "specdec_slots"  # registered with transformers next to "sdpa" (same function without a batch)
# Columns grow to a multiple of this (and by at least a quarter): few regrowths, little waste.
CONTEXT_STEP = 256
GROWTH = 1.25
MIN_SLOTS = 4
# A batch whose rows span at most this many times its size is read in place (the rows between come
# along, masked); a sparser one is gathered, which copies its own rows once.
SPAN_FACTOR = 3
STATIC = ("off", "eager", "graphs")  # SlotPool(static=...): dynamic plans only; static shapes run
                                     # eagerly (what a graph captures: the CPU's check); captured
# Widest forward the static path takes: chain rounds of up to 15 drafts and edge-only tokens. Wider
# ones are prefill chunks, whose shapes rarely repeat, and which are not launch-bound.
STATIC_MAX_WIDTH = 16
# Graphs kept (least recently used dropped first): rows buckets x widths x one column count. Their
# activations share one memory pool, replayed one at a time under the forward lock.
MAX_GRAPHS = 64

log = logging.getLogger("specdec.edge")


def slots_supported(model: torch.nn.Module) -> bool:
    """Whether ``model``'s cache is plain full attention in every layer (what slots can hold)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


class SlotLM:
    """One session's share of a :class:`SlotPool`: the same interface as
    :class:`~specdec.common.modeling.CachedLM` (forward, forward_masked, keep, truncate, cache_len)."""

    def __init__(self, pool: "SlotPool"):
        self.pool = pool
        self.model, self.device = pool.model, pool.device
        self.length = 0
        self.closed = False
        self.slot = pool._acquire(self)
        # A session dropped without release() still gives its row back.
        self._finalizer = weakref.finalize(self, pool._give_back, self.slot)

    @property
    def cache_len(self) -> int:
        return self.length

    def forward(self, new_ids: list[int], num_logits: int) -> torch.Tensor:
        """Run ``new_ids`` after the cached prefix; [num_logits, V] float32 logits of the last inputs."""
        return self.pool.forward([ForwardRequest(self, list(new_ids), num_logits)])[0]

    def forward_masked(self, new_ids: list[int], attend: torch.Tensor, positions: torch.Tensor,
                       num_logits: int) -> torch.Tensor:
        """Run ``new_ids`` with an explicit attention pattern (token trees): attend [n, cache_len + n]
        bool, positions [n] int64."""
        return self.pool.forward([ForwardRequest(self, list(new_ids), num_logits, attend, positions)])[0]

    def keep(self, indices: list[int]) -> None:
        """Compact the cache to the given cached positions, in order (the accepted tree path)."""
        self.pool._keep(self, indices)

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` tokens (the keys beyond are never seen again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def release(self) -> None:
        """The session ended: its row goes back to the pool (idempotent)."""
        self.closed = True
        self._finalizer()


@dataclass
class _Plan:
    """Where one forward's rows and tokens go (tensors on the model's device)."""
    lo: int                     # first slot of the span the attention reads
    span: int                   # rows read: hi - lo + 1 (in place), or the batch's own (gathered)
    slots_needed: int           # storage rows the batch needs: its highest slot + 1
    rows: torch.Tensor | None   # [B] batch row -> row of the span; None: the span is the batch
    gather: torch.Tensor | None  # [B] slots to gather (sparse batches); None: read in place
    length: int                 # key columns read: the longest row after this forward
    write: torch.Tensor         # [4, T] of every new token: slot, column, batch row, batch column
    mask: torch.Tensor          # [span, 1, N, length] bool: which keys each query sees
    batch_mask: torch.Tensor    # [B, 1, N, length] the batch's own rows (what the model is given)
    folded: torch.Tensor | None = None  # the mask folded for grouped queries, additive (first layer)


class SlotPool:
    """The KV slots of one model: storage, the free rows, and the batched forward over them."""

    def __init__(self, model: torch.nn.Module, device: torch.device, static: str = "off"):
        if not slots_supported(model):
            raise ValueError("KV slots need a model of plain full-attention layers (no sliding windows)")
        if static not in STATIC:
            raise ValueError(f"static must be one of {list(STATIC)}, got {static!r}")
        if static == "graphs" and torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        install_attention(model)
        self.model, self.device, self.static = model, device, static
        self._graphs: OrderedDict[tuple[int, int, int], _Graph | None] = OrderedDict()  # None: not capturable
        self._graph_pool = None        # the captured graphs' shared memory pool, made at the first capture
        self.graph_captures = 0
        self.static_forwards = 0       # forwards run in static shapes (replayed or, if not captured, eager)
        self.graph_replays = 0         # of which replayed from a CUDA graph
        self.graph_failures = 0        # shapes whose capture failed (they run eagerly)
        self._sessions: weakref.WeakValueDictionary[int, SlotLM] = weakref.WeakValueDictionary()  # slot -> its session
        self.keys: list[torch.Tensor | None] = [None] * model.config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * model.config.num_hidden_layers
        self._free: list[int] = []     # heap: the lowest free row first keeps the used ones together
        self._next = 0                 # rows ever handed out
        self._rows_lock = threading.Lock()
        self._forward_lock = threading.Lock()  # one forward (or compaction) at a time

    def new_lm(self) -> SlotLM:
        return SlotLM(self)

    @property
    def rows_in_use(self) -> int:
        with self._rows_lock:
            return self._next - len(self._free)

    def _acquire(self, lm: SlotLM) -> int:
        with self._rows_lock:
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                self._next += 1
                slot = self._next - 1
            self._sessions[slot] = lm
            return slot

    def _give_back(self, slot: int) -> None:
        with self._rows_lock:
            self._sessions.pop(slot, None)
            heapq.heappush(self._free, slot)

    def _starts(self, rows: int) -> list[int]:
        """The lengths of rows ``0..rows-1`` (0 for a free row): where a static forward writes each."""
        starts = [0] * rows
        with self._rows_lock:
            for slot, lm in list(self._sessions.items()):
                if slot < rows:
                    starts[slot] = lm.length
        return starts

    # -- the forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, requests: list[ForwardRequest], timer: PhaseTimer | None = None) -> list[torch.Tensor]:
        """All ``requests`` (sessions of this pool) in one forward: row b's [num_logits_b, V] float32
        logits, as each session alone would get them (within float tolerance)."""
        for r in requests:
            if getattr(r.lm, "pool", None) is not self:
                raise ValueError("a batch of KV slots shares one pool")
            if r.lm.closed:
                raise ValueError("forward on a session that ended")
            if not r.new_ids:
                raise ValueError("forward needs at least one new token")
        if len({id(r.lm) for r in requests}) != len(requests):
            raise ValueError("a session appears twice in one forward")
        order = sorted(range(len(requests)), key=lambda i: requests[i].lm.slot)
        batch = [requests[i] for i in order]
        with self._forward_lock:
            if timer is not None:
                timer.start()
            logits = self._run(batch, timer)
            for r in batch:  # only now: a failed forward leaves every length as it was
                r.lm.length += r.num_tokens
        out: list[torch.Tensor] = [None] * len(requests)  # type: ignore[list-item]
        for k, i in enumerate(order):
            out[i] = logits[k]
        return out

    def _run(self, batch: list[ForwardRequest], timer: PhaseTimer | None) -> list[torch.Tensor]:
        width = max(r.num_tokens for r in batch)
        rows = self._static_rows(batch, width)
        if rows:
            return self._run_static(batch, rows, width, timer)
        ids, positions, plan = _plan(batch, width, self.device)
        if timer is not None:
            timer.mark("inputs")
        self._grow(plan.slots_needed, plan.length)
        if timer is not None:
            timer.mark("copy")
        keep = max(1, max(r.num_logits for r in batch))
        cache = _slot_cache(self, plan)
        with _active(plan):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=plan.batch_mask,
                             use_cache=True, logits_to_keep=keep, **cache_kwargs(self.model, cache))
        if timer is not None:
            timer.mark("forward")
        logits = out.logits.float()
        if timer is not None:
            timer.mark("logits")
        return [logits[b, keep - r.num_logits:] for b, r in enumerate(batch)]

    # -- the static forward (see the module docstring) ---------------------------------------------
    def _static_rows(self, batch: list[ForwardRequest], width: int) -> int:
        """R, the rows a static forward of ``batch`` (sorted by slot) runs; 0: the dynamic plan."""
        if self.static == "off" or width > STATIC_MAX_WIDTH or any(k is None for k in self.keys):
            return 0  # storage is made by a first dynamic forward, when the key shape is known
        if any(r.attend is not None or r.positions is not None for r in batch):
            return 0
        return max(batch[-1].lm.slot + 1, min(1 << batch[-1].lm.slot.bit_length(), self.keys[0].shape[0]))

    def _run_static(self, batch: list[ForwardRequest], rows: int, width: int,
                    timer: PhaseTimer | None) -> list[torch.Tensor]:
        starts = self._starts(rows)
        ids = [[0] * width for _ in range(rows)]
        for r in batch:
            ids[r.lm.slot][:r.num_tokens] = r.new_ids
        positions = [list(range(s, s + width)) for s in starts]
        inputs = torch.tensor([ids, positions], dtype=torch.long)
        if torch.device(self.device).type == "cuda":  # pinned: the copy queues behind a running forward, not waits for it
            inputs = inputs.pin_memory()
        inputs = inputs.to(self.device, non_blocking=True)
        if timer is not None:
            timer.mark("inputs")
        self._grow(rows, max(starts) + width)
        if timer is not None:
            timer.mark("copy")
        logits = self._static_logits((rows, self.keys[0].shape[2], width), inputs)
        self.static_forwards += 1
        if timer is not None:
            timer.mark("forward")
        # A copy, never a view: a graph's output buffer is overwritten by its next replay.
        out = [logits[r.lm.slot, r.num_tokens - r.num_logits:r.num_tokens].to(torch.float32, copy=True)
               for r in batch]
        if timer is not None:
            timer.mark("logits")
        return out

    def _static_logits(self, key: tuple[int, int, int], inputs: torch.Tensor) -> torch.Tensor:
        """[R, W, V] logits of the static forward ``key`` = (R, columns, W) of ``inputs`` [2, R, W]."""
        if self.static == "eager":
            return self._static_call(key, inputs)
        if key not in self._graphs:
            self._graphs[key] = self._capture(key, inputs)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        graph = self._graphs[key]
        if graph is None:
            return self._static_call(key, inputs)
        graph.inputs.copy_(inputs)
        graph.graph.replay()
        self.graph_replays += 1
        return graph.logits

    def _static_call(self, key: tuple[int, int, int], inputs: torch.Tensor) -> torch.Tensor:
        rows, columns, width = key
        ids, positions = inputs[0], inputs[1]
        plan = _static_plan(positions, rows, columns, width)
        cache = _slot_cache(self, plan)
        with _active(plan):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=plan.batch_mask,
                             use_cache=True, logits_to_keep=width, **cache_kwargs(self.model, cache))
        return out.logits

    def _capture(self, key: tuple[int, int, int], inputs: torch.Tensor) -> "_Graph | None":
        """A CUDA graph of the static forward ``key``, warmed up by this forward's own ``inputs`` (it
        writes the keys it reads: running it again changes nothing). None if it cannot be captured:
        that shape runs eagerly, the same code without a graph."""
        started = time.perf_counter()
        static_inputs = inputs.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP):  # lazy initialisations (cuBLAS handles, kernels) stay out
                    self._static_call(key, static_inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the sessions' threads may use the device meanwhile (their own streams' work
            # is not captured and does not break the capture).
            with torch.cuda.graph(graph, pool=self._pool_for_capture(), capture_error_mode="thread_local"):
                logits = self._static_call(key, static_inputs)
        except Exception as exc:  # noqa: BLE001 - a shape that cannot be captured runs eagerly
            log.warning("no CUDA graph for a slot forward of %s rows x %s columns x %s tokens: %s", *key, exc)
            self.graph_failures += 1
            torch.cuda.current_stream(self.device).wait_stream(side)
            return None
        self.graph_captures += 1
        log.info("captured a CUDA graph for a slot forward of %s rows x %s columns x %s tokens in %.2f s",
                 *key, time.perf_counter() - started)
        return _Graph(graph, static_inputs, logits)

    def _pool_for_capture(self):
        """The memory pool a new graph shares with the graphs held, or a fresh one where none is held:
        once its last graph is gone, torch's allocator keeps a pool's entry (until its memory is
        released) but refuses to capture into it again (an internal assert in CUDACachingAllocator)."""
        if self._graph_pool is None or not any(g is not None for g in self._graphs.values()):
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    # -- storage -------------------------------------------------------------------------------------
    def _grow(self, rows: int, columns: int) -> None:
        """Make every allocated layer hold ``rows`` slots of ``columns`` keys (layers not allocated
        yet are made at their first write, when their shape is known). New storage drops the graphs
        (they hold the old one's addresses)."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None and (t.shape[0] < rows or t.shape[2] < columns):
                    store[i] = _regrown(t, rows, columns)
                    self._graphs.clear()

    def storage(self, layer: int, like: torch.Tensor, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s [S, H, C, D] keys and values, made on first use from a key tensor
        ``like`` [B, H, N, D] (its heads, head size, dtype and device)."""
        if self.keys[layer] is None:
            shape = (_grown(0, rows, MIN_SLOTS, 2.0), like.shape[1], _grown(0, columns, CONTEXT_STEP, GROWTH),
                     like.shape[3])
            # Zeros, not empty: a masked key is still multiplied by its zero weight, and
            # uninitialized memory may hold NaN.
            self.keys[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[layer], self.values[layer]

    def _keep(self, lm: SlotLM, indices: list[int]) -> None:
        if indices and (min(indices) < 0 or max(indices) >= lm.length):
            raise ValueError("keep(): index outside the cache")
        idx = torch.tensor(indices, dtype=torch.long, device=self.device)
        with self._forward_lock, torch.inference_mode():
            for store in (self.keys, self.values):
                for t in store:
                    if t is not None and lm.slot < t.shape[0]:
                        t[lm.slot, :, :len(indices)] = t[lm.slot].index_select(1, idx)  # a copy first
        lm.length = len(indices)


@dataclass
class _Graph:
    """One captured static forward: its input buffer [2, R, W] and output logits [R, W, V]."""
    graph: "torch.cuda.CUDAGraph"
    inputs: torch.Tensor
    logits: torch.Tensor


GRAPH_WARMUP = 2  # eager runs on a side stream before a capture, as torch.cuda.graphs' docs ask


def _grown(old: int, need: int, step: int, factor: float) -> int:
    """A new size >= need: at least ``factor`` x old, rounded up to a multiple of ``step``."""
    size = max(need, math.ceil(old * factor))
    return -(-size // step) * step


def _regrown(t: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    s, h, c, d = t.shape
    new_rows = _grown(s, rows, MIN_SLOTS, 2.0) if rows > s else s
    new_cols = _grown(c, columns, CONTEXT_STEP, GROWTH) if columns > c else c
    out = torch.zeros(new_rows, h, new_cols, d, dtype=t.dtype, device=t.device)
    out[:s, :, :c] = t
    return out


# ---------------------------------------------------------------------------------------- planning
def _plan(batch: list[ForwardRequest], width: int, device: torch.device):
    """Input ids [B, N] (left-padded), position ids [B, N], and the :class:`_Plan` of one forward,
    built on the host as plain lists and moved in a few transfers."""
    B = len(batch)
    lens = [r.lm.length for r in batch]
    slots = [r.lm.slot for r in batch]
    inputs: list[list[int]] = []   # B rows of ids, then B rows of positions
    write: list[list[int]] = [[], [], [], []]
    for b, (r, n) in enumerate(zip(batch, lens)):
        k, pad = r.num_tokens, width - r.num_tokens
        own = r.positions.tolist() if r.positions is not None else list(range(n, n + k))
        inputs.append([0] * pad + list(r.new_ids))
        inputs.append([own[0]] * pad + own)
        for column, i in enumerate(range(n, n + k), start=pad):
            for row, value in zip(write, (r.lm.slot, i, b, column)):
                row.append(value)
    moved = torch.tensor(inputs, dtype=torch.long).to(device, non_blocking=True)
    ids, positions = moved[0::2], moved[1::2]
    lo, hi = slots[0], slots[-1]
    in_place = hi - lo + 1 <= SPAN_FACTOR * B
    span = hi - lo + 1 if in_place else B
    offsets = [s - lo for s in slots] if in_place else list(range(B))
    rows = None if offsets == list(range(span)) else torch.tensor(offsets, dtype=torch.long, device=device)
    gather = None if in_place else torch.tensor(slots, dtype=torch.long, device=device)
    length = max(n + r.num_tokens for r, n in zip(batch, lens))
    seen = _seen(batch, lens, width, length, positions, device)
    mask = seen if rows is None else _spread(seen, rows, span)
    return ids, positions, _Plan(lo=lo, span=span, slots_needed=hi + 1, rows=rows, gather=gather, length=length,
                                 write=torch.tensor(write, dtype=torch.long).to(device), mask=mask,
                                 batch_mask=seen)


def _static_plan(positions: torch.Tensor, rows: int, columns: int, width: int) -> _Plan:
    """The :class:`_Plan` of a static forward from its positions [R, W] alone, on their device (inside
    a graph: no host work). Row r's token j goes to row r, column positions[r, j]; each query sees the
    columns up to its position."""
    device = positions.device
    slot = torch.arange(rows, device=device).repeat_interleave(width)
    source = torch.arange(width, device=device).repeat(rows)
    mask = (torch.arange(columns, device=device)[None, None, :] <= positions[:, :, None])[:, None]
    return _Plan(lo=0, span=rows, slots_needed=rows, rows=None, gather=None, length=columns,
                 write=torch.stack([slot, positions.reshape(-1), slot, source]), mask=mask, batch_mask=mask)


def _seen(batch: list[ForwardRequest], lens: list[int], width: int, length: int, positions: torch.Tensor,
          device: torch.device) -> torch.Tensor:
    """[B, 1, N, length] bool. A chain's query at position p sees the keys at 0..p of its row (its keys
    sit at their positions: exactly its prefix and its new tokens up to itself); a padded query sees
    its row's prefix and first new key; a tree row sees what it asked for."""
    columns = torch.arange(length, device=device)
    seen = columns[None, None, :] <= positions[:, :, None]  # [B, N, length]
    for b, (r, n) in enumerate(zip(batch, lens)):
        if r.attend is None:
            continue
        k = r.num_tokens
        if tuple(r.attend.shape) != (k, n + k):
            raise ValueError(f"attend {tuple(r.attend.shape)} does not fit {k} new tokens after {n} cached")
        tree = torch.zeros(width, length, dtype=torch.bool)
        tree[:width - k, :n + 1] = True
        tree[width - k:, :n + k] = r.attend.cpu()
        seen[b] = tree.to(device)
    return seen[:, None]


def _spread(seen: torch.Tensor, rows: torch.Tensor, span: int) -> torch.Tensor:
    """The batch's masks placed at their rows of the span; a row between them, outside the batch,
    sees its first key only (finite: its output is dropped)."""
    full = torch.zeros((span, *seen.shape[1:]), dtype=torch.bool, device=seen.device)
    full[..., 0] = True
    full[rows] = seen
    return full


# ------------------------------------------------------------------------------- transformers glue
def _slot_cache(pool: SlotPool, plan: _Plan):
    """A transformers Cache whose layer ``update`` writes the new keys into the slots and returns
    the span's keys to attend to."""
    from transformers.cache_utils import Cache, DynamicLayer

    class SlotLayer(DynamicLayer):
        def __init__(self, index: int):
            super().__init__()
            self.index = index
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = pool.storage(self.index, key_states, plan.slots_needed, plan.length)
            slot, column, row, source = plan.write  # [T] each: where every new token goes, where it is
            keys[slot, :, column] = key_states[row, :, source]
            values[slot, :, column] = value_states[row, :, source]
            if plan.gather is not None:
                return (keys[:, :, :plan.length].index_select(0, plan.gather),
                        values[:, :, :plan.length].index_select(0, plan.gather))
            end = plan.lo + plan.span
            return keys[plan.lo:end, :, :plan.length], values[plan.lo:end, :, :plan.length]

        def get_seq_length(self, *args) -> int:
            return plan.length

    return Cache(layers=[SlotLayer(i) for i in range(len(pool.keys))])


_state = threading.local()


class _active:
    """While a slot forward runs on this thread, the attention function reads its plan."""

    def __init__(self, plan: _Plan):
        self.plan = plan

    def __enter__(self):
        _state.plan = self.plan

    def __exit__(self, *exc):
        _state.plan = None


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of a slot forward (see the module docstring); any other forward of the model gets
    transformers' own sdpa attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = getattr(_state, "plan", None)
    if plan is None or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, heads, N, D = query.shape
    span, kv_heads = key.shape[0], key.shape[1]
    if plan.rows is not None:  # rows of the span outside the batch get zero queries
        full = query.new_zeros(span, heads, N, D)
        full[plan.rows] = query
        query = full
    group = heads // kv_heads
    if plan.folded is None:  # once per forward: shared by every layer
        folded = plan.mask.expand(span, group, N, plan.length) if group > 1 else plan.mask
        plan.folded = torch.zeros(folded.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~folded, float("-inf")).reshape(span, 1, group * N, plan.length)
    # query head h = kv * group + g reads key head kv: fold g into the query rows (g * N + i)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(span, kv_heads, group * N, D), key, value, attn_mask=plan.folded, scale=scaling)
    out = out.reshape(span, heads, N, D)
    if plan.rows is not None:
        out = out[plan.rows]
    return out.transpose(1, 2).contiguous(), None


def install_attention(model: torch.nn.Module) -> None:
    """Register :func:`slot_attention` with transformers and make ``model`` use it (idempotent; a
    forward outside a slot forward runs transformers' sdpa exactly as before)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # masks it builds itself: sdpa's
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        return
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (AttributeError, ValueError):  # a transformers that checks names against its own list
        model.config._attn_implementation = ATTENTION_NAME
