"""What one forward costs on this device: the memory-bandwidth floor, the cost curves of both KV
layouts, the phases of one batched round, and what a CUDA graph would save.

Every time is wall time around work the device has finished (a synchronisation before and after),
the median of ``repeats`` runs after ``warmup``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdec.edge.batched import BatchWorkspace, ForwardRequest, PhaseTimer, forward_batch
from specdec.common.codecs import CodecConfig, decode_distribution, encode_distribution
from specdec.common.distributions import densify
from specdec.common.modeling import CachedLM, cache_kwargs
from specdec.common.sampling import TargetLaw, model_probs
from specdec.common.modes import Mode
from specdec.edge.slots import SlotPool
from specdec.common.streams import Purpose, stream
from specdec.common.verification import chain_verify, token_noise
from specdec.edge.noise_ahead import draw_ahead, kept
from specdec.edge.verify_batch import chain_round, gumbel_round, verify_rounds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict:
    """A device-to-device copy of ``nbytes``: bytes read plus written per second (the rate a forward
    reads its weights at, at best)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats, warmup=2)
    del src, dst
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


# ------------------------------------------------------------------------------------ sessions
class Sessions:
    """``count`` sessions of one model, each holding ``context`` cached tokens of random keys and
    values (a forward's cost does not depend on their values), in one of the two KV layouts."""

    @torch.inference_mode()  # the pool's storage is made in a forward: an inference tensor
    def __init__(self, model, device: torch.device, count: int, context: int, layout: str, room: int):
        self.model, self.device, self.context, self.layout = model, device, context, layout
        self.workspace = BatchWorkspace()
        if layout == "slots":
            self.pool = SlotPool(model, device)
            self.lms = [self.pool.new_lm() for _ in range(count)]
            self.lms[-1].forward([1], 1)  # makes every layer's storage, with room for all rows
            self.pool._grow(count, context + room)
            for store in (self.pool.keys, self.pool.values):
                for t in store:
                    t.normal_()
            for lm in self.lms:
                lm.length = context
        else:
            self.pool = None
            probe = CachedLM(model, device)
            probe.forward([1], 1)  # the layers' head counts and sizes, as the model writes them
            shapes = [(*layer.keys.shape[:-2], context, layer.keys.shape[-1]) for layer in probe.cache.layers]
            self.lms = [self._filled_cache(shapes, probe.cache.layers[0].keys.dtype) for _ in range(count)]

    def _filled_cache(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> CachedLM:
        lm = CachedLM(self.model, self.device)
        for i, shape in enumerate(shapes):
            k = torch.randn(shape, dtype=dtype, device=self.device)
            lm.cache.update(k, torch.randn_like(k), i)
        return lm

    def forward(self, batch: int, tokens: int, timer: PhaseTimer | None = None) -> list[torch.Tensor]:
        """``batch`` sessions x ``tokens`` new tokens, all logits; rolled back after."""
        ids = [(7 * i + 3) % 50 + 1 for i in range(tokens)]
        requests = [ForwardRequest(lm, ids, tokens) for lm in self.lms[:batch]]
        out = forward_batch(requests, self.workspace, timer)
        for lm in self.lms[:batch]:
            lm.truncate(self.context)
        return out


@dataclass(frozen=True)
class CurvePlan:
    tokens: tuple[int, ...]          # c(T): one session, T new tokens
    batches: tuple[int, ...]         # c(B x L): B sessions
    batch_tokens: tuple[int, ...]    # L of each session in c(B x L)
    contexts: tuple[int, ...]        # cached tokens of every session
    per_session_batches: tuple[int, ...]  # the per-session layout, at these B only (copies cost memory)
    repeats: int = 5
    warmup: int = 2


def cost_curves(model, device: torch.device, plan: CurvePlan) -> dict:
    """{layout: {context: {"T": {T: s}, "BxL": {L: {B: s}}}}} (seconds per forward)."""
    out: dict = {}
    for layout in ("slots", "per-session"):
        out[layout] = {}
        batches = plan.batches if layout == "slots" else plan.per_session_batches
        for context in plan.contexts:
            sessions = Sessions(model, device, max(batches), context, layout, room=max(plan.tokens))
            curve = {"T": {}, "BxL": {}}
            if layout == "slots":
                for t in plan.tokens:
                    curve["T"][t] = median_seconds(lambda: sessions.forward(1, t), device, plan.repeats, plan.warmup)
            for length in plan.batch_tokens:
                curve["BxL"][length] = {b: median_seconds(lambda: sessions.forward(b, length), device,
                                                          plan.repeats, plan.warmup) for b in batches}
            out[layout][context] = curve
            del sessions
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ phases
def phases(model, device: torch.device, batch: int, drafts: int, context: int, vocab: int,
           repeats: int = 3) -> dict:
    """Seconds per phase of one batched verification round (``batch`` sessions x ``drafts`` + 1
    tokens) in both layouts: building the inputs, copying caches, the forward, appending keys, the
    logits' conversion; then the verification of every session's round (decoding its packets, the
    target's probabilities at T = 0 and T = 1, the accept tests and the bonus): all rounds together as
    batch tensor work on the device (``verify_batched``, the edge's path: edge/verify_batch.py), and
    session by session on the device and on the host (``verify_device``, ``verify_host``: the paths
    the edge had before); and the same drafts as gumbel rounds at T = 1 with and without the noise
    drawn ahead (:func:`_gumbel_with_and_without_noise_ahead`)."""
    codec = CodecConfig(mode=Mode.TSLT, vocab_size=vocab, top_k=1)
    out = {}
    for layout in ("slots", "per-session"):
        sessions = Sessions(model, device, batch, context, layout, room=drafts + 1)
        first = sessions.forward(batch, drafts + 1)  # warm; the same inputs give the same drafts below
        rounds = [_round(row, drafts, codec) for row in first]
        timings = []
        for _ in range(repeats):
            timer = PhaseTimer(lambda: sync(device))
            timer.start()
            logits = sessions.forward(batch, drafts + 1, timer)
            for temperature in (0.0, 1.0):
                for place in ("device", "host"):
                    target = device if place == "device" else torch.device("cpu")
                    for b, (row, (ids, payloads)) in enumerate(zip(logits, rounds)):
                        _verify(row, ids, payloads, codec, temperature, target, b)
                    timer.mark(f"verify_{place}_T{temperature:g}")
                _verify_batched(logits, rounds, codec, temperature)
                timer.mark(f"verify_batched_T{temperature:g}")
            _gumbel_with_and_without_noise_ahead(logits, rounds, vocab, timer)
            timings.append(timer.seconds)
        out[layout] = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
        del sessions
    return out


def _round(row: torch.Tensor, drafts: int, codec: CodecConfig) -> tuple[list[int], list[bytes]]:
    """A session's drafts (the target's own tokens: all accepted, the bonus drawn) and their packets."""
    ids = row[:drafts].argmax(-1).tolist()
    payloads = []
    for x in ids:
        q = torch.zeros(codec.vocab_size)
        q[x] = 1.0
        payloads.append(encode_distribution(q, codec).payload)
    return ids, payloads


def _verify(row: torch.Tensor, ids: list[int], payloads: list[bytes], codec: CodecConfig, temperature: float,
            place: torch.device, session: int) -> int:
    """The edge's verification of one round (edge/verifier.py's chain path) where ``place`` says."""
    p = model_probs(row if row.device == place else row.to(place), temperature)  # [L+1, V] float64
    q = torch.stack([densify(decode_distribution(x, codec), place) for x in payloads])
    result = chain_verify(torch.tensor(ids, dtype=torch.long, device=place), q, p,
                          stream(session, Purpose.VERIFY, 0))
    return result.next_token


def _verify_batched(logits: list[torch.Tensor], rounds: list[tuple[list[int], list[bytes]]], codec: CodecConfig,
                    temperature: float) -> list[int]:
    """The edge's verification of all the rounds of one forward together (edge/verify_batch.py)."""
    law = TargetLaw(temperature)
    built = [chain_round(torch.tensor(ids), [decode_distribution(x, codec) for x in payloads], law,
                         stream(b, Purpose.VERIFY, 0)) for b, (ids, payloads) in enumerate(rounds)]
    return [o.next_token for o in verify_rounds(list(logits), built)]


def _gumbel_with_and_without_noise_ahead(logits: list[torch.Tensor], rounds: list[tuple[list[int], list[bytes]]],
                                         vocab: int, timer) -> None:
    """The same drafts as gumbel rounds at T = 1, verified together: the race noise drawn by the
    verification (``verify_batched_gumbel_T1``), or drawn ahead (``noise_ahead_draws_gumbel_T1``: what
    the sessions' threads draw while the forward runs, edge/noise_ahead.py) and then verified
    (``verify_batched_gumbel_T1_noise_ahead``: what is left on the scheduler's thread)."""
    law = TargetLaw(1.0)

    def built() -> list:
        return [gumbel_round(torch.tensor(ids), law, lambda i, b=b: token_noise(b, i, vocab))
                for b, (ids, _) in enumerate(rounds)]
    plain = built()
    timer.mark("verify_batched_gumbel_T1_build")
    verify_rounds(list(logits), plain)
    timer.mark("verify_batched_gumbel_T1")
    ahead = [kept(r) for r in built()]
    for r in ahead:
        draw_ahead(r, lambda: False)
    timer.mark("noise_ahead_draws_gumbel_T1")
    verify_rounds(list(logits), ahead)
    timer.mark("verify_batched_gumbel_T1_noise_ahead")


# ------------------------------------------------------------------------------------ CUDA graphs
def graph_probe(model, device: torch.device, batch: int, tokens: int, context: int, repeats: int = 10) -> dict:
    """What capturing one slot forward of ``batch`` x ``tokens`` in a CUDA graph would save: the eager
    forward against replays of the same forward with its inputs, plan and cache held static (a
    measurement of the headroom, not the serving path). CUDA only; failures are reported."""
    if device.type != "cuda":
        return {"available": False, "why": "CUDA only"}
    from specdec.edge import slots

    sessions = Sessions(model, device, batch, context, "slots", room=tokens)
    requests = [ForwardRequest(lm, [3] * tokens, tokens) for lm in sessions.lms[:batch]]
    ids, positions, plan = slots._plan(requests, tokens, device)
    cache = slots._slot_cache(sessions.pool, plan)
    kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=plan.batch_mask, use_cache=True,
                  logits_to_keep=tokens, **cache_kwargs(model, cache))

    def eager():
        with torch.inference_mode(), slots._active(plan):
            return model(**kwargs).logits

    result = {"batch": batch, "tokens": tokens, "context": context,
              "eager_s": median_seconds(eager, device, repeats, warmup=3)}
    try:
        stream_ = torch.cuda.Stream(device)
        stream_.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream_):
            for _ in range(3):
                eager()
        torch.cuda.current_stream(device).wait_stream(stream_)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = eager()
        result["graph_s"] = median_seconds(graph.replay, device, repeats, warmup=2)
        result["same_logits"] = bool(torch.allclose(static_out.float(), eager().float(), atol=1e-2, rtol=1e-2))
        result["speedup"] = result["eager_s"] / result["graph_s"]
    except Exception as exc:  # noqa: BLE001 - a measurement of headroom: its failure is a finding
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    del sessions
    return result


# ------------------------------------------------------------------------------------ the scheduler
PROBE_PROMPT = 32        # the capacity run's prompt length
PROBE_STEPS = 40         # one-token forwards per way
PROFILED_STEPS = 8       # more of the growing way's, under torch.profiler
PROFILE_ROWS = 25


def scheduler_probe(model, device: torch.device, vocab: int, steps: int = PROBE_STEPS) -> dict:
    """One session's one-token forwards (edge-only's rounds) three ways, to place the time an
    edge-server's forward takes beyond its cost curve (the capacity run's forwards): the slot pool's
    forward called here at a fixed length (the cost curve's way), the same with the length growing by
    one a forward (a session's way; on CUDA also with cuDNN's attention, which
    :func:`~specdec.common.modeling.serving_attention` turns off), and handed to a ForwardScheduler's
    thread (the edge's way, its forward timed as the edge times it); on CUDA, the growing and the
    scheduler's ways again with the forwards replayed from CUDA graphs (``*_graphs_s``, the edge's
    default there). Medians in seconds, and
    torch.profiler's table of a few of the growing way's forwards (the ops by self CPU time: where a
    launch-bound forward's host time goes)."""
    from specdec.edge.batching import BatchSettings

    pool = SlotPool(model, device)
    lm = pool.new_lm()
    ids = [(7 * i + 3) % vocab for i in range(PROBE_PROMPT)]
    lm.forward(ids, 1)
    one = lambda: pool.forward([ForwardRequest(lm, [ids[lm.length % PROBE_PROMPT]], 1)])  # noqa: E731

    def fixed():
        one()
        lm.truncate(PROBE_PROMPT)

    out = {"fixed_length_s": median_seconds(fixed, device, steps, warmup=3),
           "growing_length_s": median_seconds(one, device, steps, warmup=3)}
    if device.type == "cuda":  # the control: what the backend serving_attention turns off costs
        enabled = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(True)
        try:
            out["growing_length_cudnn_s"] = median_seconds(one, device, steps, warmup=3)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(enabled)
    with torch.profiler.profile() as prof:  # this thread's ops only: here, not the scheduler's
        for _ in range(PROFILED_STEPS):
            one()
        sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    out["profile"] = table.splitlines()
    out.update(_through_scheduler(pool, lm, ids, device, steps, BatchSettings(cuda_graphs="off")))
    lm.release()
    if device.type == "cuda":  # the edge's CUDA default: the same forwards replayed from CUDA graphs
        graphs = SlotPool(model, device, static="graphs")
        lm = graphs.new_lm()
        lm.forward(ids, 1)
        one = lambda: graphs.forward([ForwardRequest(lm, [ids[lm.length % PROBE_PROMPT]], 1)])  # noqa: E731
        out["growing_length_graphs_s"] = median_seconds(one, device, steps, warmup=3)
        got = _through_scheduler(graphs, lm, ids, device, steps, BatchSettings(cuda_graphs="on"))
        # scheduler_wall_s -> scheduler_wall_graphs_s, error -> error_graphs
        out.update({f"{k.removesuffix('_s')}_graphs_s" if k.endswith("_s") else f"{k}_graphs": v
                    for k, v in got.items()})
        out["graph_captures"] = graphs.graph_captures
        lm.release()
    return out


def _through_scheduler(pool, lm, ids: list[int], device: torch.device, steps: int, settings) -> dict:
    """One session's one-token forwards handed to a ForwardScheduler's thread: the median wall time
    a forward takes for the session, and the forward as the edge times it."""
    from specdec.edge.batching import ForwardScheduler

    seen: list[float] = []
    sched = ForwardScheduler(settings, observer=lambda s: seen.append(s.forward_seconds), pool=pool, device=device)
    out: dict = {}
    try:
        with sched.working():
            step = lambda: sched.forward(ForwardRequest(lm, [ids[lm.length % PROBE_PROMPT]], 1))  # noqa: E731
            out["scheduler_wall_s"] = median_seconds(step, device, steps, warmup=3)
            out["scheduler_forward_s"] = statistics.median(seen[3:]) if len(seen) > 3 else None
    except Exception as exc:  # noqa: BLE001 - a probe: report, do not stop the check
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        sched.stop()
    return out
