"""Fuzzing a live edge-server subprocess with malformed and adversarial sessions.

Corpus: real sessions of every mode (chains and a token tree, greedy and sampled, DSSD with its
rejections and fallbacks), recorded on the wire by running the real device client against the edge
under test. Every fuzz input is one stream on a shared channel, sent as raw bytes through a generic
stream call (identity request serializer), so anything can go on the wire:

  a. fields (hypothesis): recorded sessions with message fields set to adversarial values (ids out
     of range or huge, random round ids, enum values nobody defined, zero and huge DraftSettings,
     NaN/inf floats, random bytes as distributions, mismatched counts, other modes' payloads) and
     messages dropped, duplicated, reordered or inserted (Draft before Hello, two Hellos, Prompt
     twice, ResidualRequest out of the blue, Close first, empty and oversized messages), a few
     with missing or wrong credentials;
  b. bytes (hypothesis): a serialized DeviceMessage, or one codec payload inside a Draft,
     bit-flipped, truncated, extended, spliced with another message or payload;
  c. hijacks: another principal or a wrong secret trying to resume a live session;
  d. silent clients that open a session and never speak again.

Oracle per stream: the edge ends it within CALL_TIMEOUT_S with a status; a status other than OK is
a session status with a message (never INTERNAL); OK only for a well-formed session, whose answers
then match its drafts; undecodable bytes end their session with INVALID_ARGUMENT ("undecodable
message"). Trees and tree depths are fuzzed up to 2**32 - 1 (a huge tree in a Hello or a tree_depth
in a chain once froze the edge). Meanwhile greedy sessions of every mode run on the real
device client alongside and must equal the target alone; afterwards the process is alive, has
freed every session, and serves a fresh session correctly.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import queue
import re
import struct
import threading
import time
import urllib.request

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.harness import EdgeProcess, device_config, load, target_greedy
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.pb import speculative_pb2 as pb
from specdec.common import wire
from specdec.device.client import ConnectionPolicy, generate
from specdec.edge.servicer import RESUME_TOKEN_BYTES, SESSION_ID_RE
from specdec.device.session import DraftSession
from specdec.device.factory import open_channel
from specdec.testbed import procs

METHOD = "/specdec.v1.SpeculativeDecoding/Generate"
PROMPT = "w1 w2 w3"
MAX_NEW = 16                     # tokens per recorded / well-behaved session
TOKENS = ("fuzz-token-a", "fuzz-token-b")  # a: the fuzzer and the good sessions; b: another principal
AUTH_A = (("authorization", f"Bearer {TOKENS[0]}"),)
AUTH_B = (("authorization", f"Bearer {TOKENS[1]}"),)
CALL_TIMEOUT_S = 30.0            # a stream the edge has not ended by then is a hang
IDLE_TIMEOUT_S = 4.0             # the edge's --idle-timeout: silent clients are cut after this
RESUME_WINDOW_S = 0.5            # streams ending without Close keep their session this long
MAX_MESSAGE_BYTES = 1 << 20      # the edge's --max-message-bytes; one fuzz op goes beyond it
MAX_SESSIONS = 256               # room for detached sessions waiting out their resume window
SHORT_EXAMPLES = 300             # per hypothesis part in the default suite (600 inputs + c, d)
LONG_EXAMPLES = 6000             # per part behind -m slow: 12,000 inputs + c, d
# Statuses a session may end with; PERMISSION_DENIED is a resume attempt on someone else's session.
SESSION_STATUSES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Bytes that are no DeviceMessage end their session with this status and message.
UNDECODABLE = (grpc.StatusCode.INVALID_ARGUMENT, "undecodable message")

# Settings that make every mode compress on the 512-token vocabulary (as test_end_to_end).
MODE_SETTINGS = {Mode.DENSE: {"dense_dtype": "fp16"}, Mode.TSLT: {"top_k": 16},
                 Mode.KSQS: {"top_k": 16, "lattice": 64},
                 Mode.CSQS: {"csqs_beta0": 0.01, "lattice": 64, "max_k": 64},
                 Mode.DSSD: {"dssd_samples": 1}, Mode.NONE: {}, Mode.GUMBEL: {}}
# Recorded sessions: (mode, temperature, extra settings); sampled DSSD brings rejections/fallbacks.
CORPUS = [(m, t, {}) for m in Mode for t in (0.0, 1.0)] + [
    (Mode.TSLT, 0.0, {"tree": (2, 2)}), (Mode.CSQS, 1.0, {"tree": (3, 1)}),
    (Mode.DENSE, 1.0, {"dense_dtype": "bf16"}), (Mode.DENSE, 0.0, {"dense_dtype": "fp32"})]
GOOD_SESSION_PAUSE_S = 2.0       # between well-behaved sessions running alongside
RECENT_INPUTS = 10               # inputs kept to report what killed or hung the edge
DSSD_FALLBACK_TRIES = 20         # seeds tried for a recorded DSSD session with a ResidualRequest


# ------------------------------------------------------------------------------------ the edge


class _Edge:
    """The edge-server subprocess, its log drained (a full pipe would block it), its /metrics."""

    def __init__(self, target_dir, token_file):
        self.metrics_port = procs.free_port()
        self.proc = EdgeProcess(
            "--model", str(target_dir), "--threads", "1", "--workers", "2",
            "--idle-timeout", str(IDLE_TIMEOUT_S), "--resume-window", str(RESUME_WINDOW_S),
            "--max-sessions", str(MAX_SESSIONS), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
            "--auth-token-file", str(token_file), "--metrics-port", str(self.metrics_port))
        self.log: collections.deque[str] = collections.deque(self.proc.lines, maxlen=400)
        self.log_counts: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.proc.stdout:
            self.log.append(line)
            if "session failed" in line:
                self.log_counts["session failed (INTERNAL)"] += 1
            elif "Unexpected [" in line:
                self.log_counts[line.split("Unexpected ")[1].split(" raised")[0]] += 1

    @property
    def address(self) -> str:
        return self.proc.address

    def alive(self) -> bool:
        return self.proc.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        return "".join(list(self.log)[-n:])

    def metric(self, series: str) -> float:
        """The value of one series (name and labels as exposed) on the edge's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.M).group(1))

    def sessions_active(self) -> float:
        return self.metric("specdec_edge_sessions_active")


_COUNT_LOCK = threading.Lock()


@dataclasses.dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list            # EdgeMessages received before the status (an End announcing it left out)
    seconds: float
    complete: bool = False   # the End was OK: the session held every token asked for, and the edge stopped


@dataclasses.dataclass
class Fuzz:
    """Everything an input needs: the edge, a raw stream call, the corpus and what to compare with."""
    edge: _Edge
    target_dir: object
    drafter_dir: object
    call: object                         # raw bytes in, raw bytes out
    vocab_size: int
    fingerprint: str
    prompt_ids: list[int]
    expected: list[int]                  # target alone, greedy, MAX_NEW tokens
    corpus: list[list[bytes]] = dataclasses.field(default_factory=list)  # recorded sessions
    bank: list[bytes] = dataclasses.field(default_factory=list)     # every message and payload seen
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    slowest: float = 0.0
    stream_seconds: float = 0.0          # total time inside fuzz streams
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RECENT_INPUTS))
    broken: str | None = None            # why the edge can no longer be fuzzed (dead or hung)

    def send(self, chunks: list[bytes], metadata=AUTH_A) -> Outcome:
        # Once the edge is dead or hung every input fails: fail fast, so that hypothesis' shrinking
        # does not spend minutes on inputs that prove nothing, and keep the first culprit's report.
        assert self.broken is None, self.broken
        self.recent.append((chunks, metadata))
        t0 = time.monotonic()
        replies = []
        try:
            for raw in self.call(iter(chunks), timeout=CALL_TIMEOUT_S, metadata=metadata):
                replies.append(pb.EdgeMessage.FromString(raw))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        complete = False
        if replies and replies[-1].HasField("end"):  # the edge's status announced first (Hello.wants_end);
            end = replies.pop().end                  # gRPC itself may still end the call otherwise (an
            assert end.details, end                  # oversized message the device goes on sending);
            # code 0: a session complete, whose status is OK unless gRPC refused such a message meanwhile
            oversized = (code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
                         and any(len(c) > MAX_MESSAGE_BYTES for c in chunks))
            assert end.code or code is grpc.StatusCode.OK or oversized, (end, code, details)
            complete = not end.code
        seconds = time.monotonic() - t0
        self.slowest = max(self.slowest, seconds)
        self.stream_seconds += seconds
        return Outcome(code, details, replies, seconds, complete)

    def count(self, part: str, out: Outcome) -> None:
        with _COUNT_LOCK:  # silent clients count from their own threads
            self.statuses[(part, out.code.name)] += 1

    def inputs(self, part: str | None = None) -> int:
        return sum(n for (p, _), n in self.statuses.items() if part in (None, p))


@pytest.fixture(scope="module")
def fuzz(tiny_pair_v512, tmp_path_factory):
    target_dir, drafter_dir = tiny_pair_v512
    token_file = tmp_path_factory.mktemp("fuzz") / "tokens"
    token_file.write_text("\n".join(TOKENS) + "\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(_Edge, target_dir, token_file)  # boots while this process loads models
        drafter = load(str(drafter_dir))
        prompt_ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
        expected = target_greedy(target_dir, prompt_ids, MAX_NEW)
        edge = starting.result()
    channel = grpc.insecure_channel(edge.address, options=[("grpc.max_receive_message_length", -1)])
    try:
        ctx = Fuzz(edge=edge, target_dir=target_dir, drafter_dir=drafter_dir,
                   call=channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None),
                   vocab_size=drafter.vocab_size, fingerprint=vocab_fingerprint(drafter.tokenizer),
                   prompt_ids=prompt_ids, expected=expected)
        _record_corpus(ctx)
        yield ctx
    finally:
        channel.close()
        edge.proc.stop()


# ------------------------------------------------------------------------ well-behaved sessions


async def _good_session(ctx: Fuzz, channel, mode: Mode, temperature: float = 0.0, seed: int = 0,
                        extra: dict | None = None, record: list | None = None) -> list[int]:
    """One session on the real device client (optionally recording its DeviceMessages)."""
    drafter = load(str(ctx.drafter_dir))
    cfg = device_config(mode=mode, temperature=temperature, max_new_tokens=MAX_NEW,
                        **{**MODE_SETTINGS[mode], **(extra or {})})
    hello = cfg.hello(ctx.fingerprint, ctx.vocab_size, seed=seed)
    if record is not None:
        channel = _RecordingChannel(channel, record)
    r = await generate(channel, DraftSession(drafter, hello), hello, ctx.prompt_ids, drafter.eos_token_ids,
                       timeout=120, policy=ConnectionPolicy(metadata=AUTH_A))
    return r.token_ids


async def _good_loop(ctx: Fuzz, stop: asyncio.Event) -> list[tuple[Mode, list[int]]]:
    """Greedy sessions of each mode in turn until the fuzzing is over (at least one)."""
    runs = []
    async with open_channel(ctx.edge.address) as channel:
        while not stop.is_set() or not runs:
            mode = list(Mode)[len(runs) % len(Mode)]
            runs.append((mode, await _good_session(ctx, channel, mode)))
            with contextlib.suppress(asyncio.TimeoutError):  # leave the shared cores to the fuzzer
                await asyncio.wait_for(stop.wait(), GOOD_SESSION_PAUSE_S)
    return runs


class _RecordingChannel:
    """A grpc.aio channel whose stream calls record every DeviceMessage written, serialized."""

    def __init__(self, channel, record: list):
        self._channel, self._record = channel, record

    def stream_stream(self, *args, **kwargs):
        multicallable = self._channel.stream_stream(*args, **kwargs)
        record = self._record

        class Call:
            def __init__(self, call):
                self._call = call

            async def write(self, msg):
                record.append(msg.SerializeToString())
                await self._call.write(msg)

            def __getattr__(self, name):
                return getattr(self._call, name)

        return lambda *a, **kw: Call(multicallable(*a, **kw))

    def __getattr__(self, name):  # the rest of the channel (get_state, channel_ready, ...) as it is
        return getattr(self._channel, name)


def _record_corpus(ctx: Fuzz) -> None:
    """Record one real session per CORPUS entry; replayed as raw bytes, each must answer the same."""
    async def main():
        async with open_channel(ctx.edge.address) as channel:
            for i, (mode, temperature, extra) in enumerate(CORPUS):
                record: list[bytes] = []
                await _good_session(ctx, channel, mode, temperature, seed=i, extra=extra, record=record)
                ctx.corpus.append(record)
            for seed in range(100, 100 + DSSD_FALLBACK_TRIES):  # and one DSSD session with a fallback
                record = []
                await _good_session(ctx, channel, Mode.DSSD, 1.0, seed=seed, record=record)
                if any(_kind(pb.DeviceMessage.FromString(m)) == "residual_request" for m in record):
                    ctx.corpus.append(record)
                    break

    asyncio.run(main())
    kinds = collections.Counter(_kind(pb.DeviceMessage.FromString(m)) for s in ctx.corpus for m in s)
    assert kinds["residual_request"] >= 1, f"no DSSD fallback in the corpus: {kinds}"
    # the default fallback is p_j's head: counted as such, with its bytes
    assert ctx.edge.metric('specdec_edge_dssd_fallbacks_total{reply="head"}') >= 1
    assert ctx.edge.metric("specdec_edge_dssd_fallback_bytes_total") > 0
    for session in ctx.corpus:
        out = ctx.send(session)
        assert out.code == grpc.StatusCode.OK, (out.code, out.details)
        _check_well_formed(ctx, [pb.DeviceMessage.FromString(m) for m in session], out.replies, out.complete)
        for raw in session:
            msg = pb.DeviceMessage.FromString(raw)
            ctx.bank.append(raw)
            if msg.HasField("draft"):
                ctx.bank.extend(msg.draft.distributions)
                if msg.draft.dssd_scalars:
                    ctx.bank.append(msg.draft.dssd_scalars)


# ------------------------------------------------------------------------------------- oracle


def _kind(msg) -> str:
    return "undecodable" if msg is None else (msg.WhichOneof("kind") or "empty")


def _parse(raw: bytes):
    try:
        return pb.DeviceMessage.FromString(raw)
    except DecodeError:
        return None


def _check_well_formed(ctx: Fuzz, msgs: list, replies: list, complete: bool = False) -> None:
    """An OK session: Hello, Prompt, rounds, then Close or end of stream (which may also come right
    after Hello: the session waits for a resume), or the round that made it ``complete``; one answer
    per request."""
    kinds = [_kind(m) for m in msgs]
    read = kinds[: kinds.index("close")] if "close" in kinds else kinds  # the edge stops at Close
    if complete:  # ... or at the round after which it held every token asked for (End OK): the rest dropped
        read = read[:2 + len(_answers(replies[1:]))]
    assert read == ["hello"] and "close" not in kinds or (
        read[:2] == ["hello", "prompt"] and all(k in ("draft", "residual_request") for k in read[2:])), \
        f"OK for a malformed session: {kinds}"
    requests = msgs[2:len(read)]
    answers = _answers(replies[1:])
    assert len(answers) == len(requests), f"{len(replies)} replies, {len(answers)} answers to {kinds}"
    assert replies[0].HasField("welcome") and replies[0].welcome.vocab_size == ctx.vocab_size
    for req, answer in zip(requests, answers):
        if len(answer) > 1:  # an edge-only round (mode none): one Verdict per token, `more` on all but the last
            assert req.HasField("draft") and not req.draft.token_ids, (req, answer)
            assert all(a.verdict.round_id == req.draft.round_id and a.verdict.next_token < ctx.vocab_size
                       for a in answer), answer
        rep = answer[-1]
        if req.HasField("draft"):
            d, v = req.draft, rep.verdict
            assert rep.HasField("verdict") and v.round_id == d.round_id, (req, rep)
            assert v.num_accepted <= len(wire.draft_from_pb(d).token_ids), (req, rep)  # ids plain or packed
            assert not v.HasField("next_token") or v.next_token < ctx.vocab_size, rep
            assert all(t < ctx.vocab_size for t in v.reject_samples), rep
            assert all(0.0 < p <= 1.0 for p in v.reject_sample_probs), rep
        else:
            r = rep.residual
            assert rep.HasField("residual") and r.round_id == req.residual_request.round_id, (req, rep)
            if r.head_ids:  # p_j's head, its tail's mass and samples of the tail (ids outside the head)
                assert not r.target_probs and len(r.head_probs) == len(r.head_ids), rep
                assert len(set(r.head_ids)) == len(r.head_ids) and not set(r.tail_samples) & set(r.head_ids), rep
                assert all(t < ctx.vocab_size for t in (*r.head_ids, *r.tail_samples)), rep
                assert all(0.0 < p <= 1.0 for p in (*r.head_probs, *r.tail_sample_probs)), rep
                assert math.isclose(sum(r.head_probs) + r.tail_mass, 1.0, abs_tol=1e-6), rep
                continue
            assert len(r.target_probs) == 8 * ctx.vocab_size
            probs = struct.unpack(f"<{ctx.vocab_size}d", r.target_probs)
            assert all(p >= 0 for p in probs) and math.isclose(sum(probs), 1.0, abs_tol=1e-6)


def _answers(replies: list) -> list[list]:
    """Replies grouped by the request they answer: an answer ends with a reply that is not a
    Verdict with ``more`` set (edge-only rounds stream one Verdict per token)."""
    out, current = [], []
    for rep in replies:
        current.append(rep)
        if not (rep.HasField("verdict") and rep.verdict.more):
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _check(ctx: Fuzz, part: str, chunks: list[bytes], out: Outcome, metadata=AUTH_A,
           allowed: frozenset | None = None) -> None:
    """The oracle every fuzz input goes through (see the module docstring)."""
    ctx.count(part, out)
    if not ctx.edge.alive():
        _broken(ctx, "edge-server died")
    if out.seconds >= CALL_TIMEOUT_S or out.details == "Deadline Exceeded":
        _broken(ctx, f"edge did not end a stream within {CALL_TIMEOUT_S:g} s ({out.code.name})")
    assert out.code != grpc.StatusCode.INTERNAL, f"INTERNAL: {out.details}\n{ctx.edge.log_tail()}"
    if metadata not in (AUTH_A, AUTH_B):  # wrong or missing credentials: refused before anything is read
        # ... or before that, by gRPC itself, when a message beyond the edge's size limit arrives first
        oversized = (out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in out.details
                     and any(len(c) > MAX_MESSAGE_BYTES for c in chunks))
        assert (out.code == grpc.StatusCode.UNAUTHENTICATED or oversized) and not out.replies, out
        return
    msgs = [_parse(c) for c in chunks]
    if out.code == grpc.StatusCode.OK:
        _check_well_formed(ctx, msgs, out.replies, out.complete)
    elif UNDECODABLE[1] in out.details:
        assert out.code == UNDECODABLE[0] and None in msgs, out
    else:
        assert out.code in SESSION_STATUSES, out
        assert out.details, f"{out.code.name} without a message"
    if allowed is not None:
        assert out.code in allowed, out
    oversized = any(len(c) > MAX_MESSAGE_BYTES for c in chunks)  # grpc refuses it, maybe first
    if not oversized and (not msgs or _kind(msgs[0]) not in ("hello", "undecodable")):
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out  # "expected Hello" or "empty DeviceMessage"


def _broken(ctx: Fuzz, why: str) -> None:
    """The edge died or hung: report the inputs that led there and stop fuzzing it."""
    inputs = "\n".join(f"  {metadata!r} {chunks!r}" for chunks, metadata in ctx.recent)
    ctx.broken = (f"{why}; the last {len(ctx.recent)} inputs, oldest first (metadata, messages):\n{inputs}\n"
                  f"edge log:\n{ctx.edge.log_tail()}")
    raise AssertionError(ctx.broken)


# ---------------------------------------------------------------------- strategies: part a (fields)


def _uints(bits: int):
    top = 2**bits - 1
    edges = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 255, 256, 511, 512, 513, 4096, 8192, 8193,
             2**31 - 1, 2**31, top]
    return st.one_of(st.sampled_from([e for e in edges if e <= top]), st.integers(0, top))


U32, U64 = _uints(32), _uints(64)
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-30, 3.4e38, math.inf, -math.inf, math.nan]),
                   st.floats(width=32))
ENUMS = st.one_of(st.integers(0, 6), st.sampled_from([-1, 99, 2**31 - 1, -(2**31)]))


def _token_ids(vocab_size: int):
    return st.one_of(st.integers(0, vocab_size - 1), st.sampled_from([vocab_size, vocab_size + 1, 2**31, 2**32 - 1]))


def _tree_nodes(ks) -> int:
    width, nodes = 1, 1
    for k in ks:
        width *= k
        nodes += width
    return nodes


def _field_strategies(ctx: Fuzz) -> dict[str, object]:
    """Adversarial values by field name, where the type alone says too little."""
    ids = _token_ids(ctx.vocab_size)
    id_lists = st.one_of(st.lists(ids, max_size=40),
                         st.builds(lambda n, t: [t] * n, st.integers(200, 400), ids))  # context limits
    bank = st.sampled_from(ctx.bank)
    scalars = st.lists(FLOATS.map(lambda x: struct.pack("<d", x)), max_size=6).map(b"".join)
    return {
        "tree": st.lists(st.one_of(st.integers(0, 8), U32), max_size=40),
        "token_ids": id_lists,
        "distributions": st.lists(st.one_of(bank, st.binary(max_size=80)), max_size=40),
        "dssd_scalars": st.one_of(scalars, bank, st.binary(max_size=80)),
        "correction_token": st.one_of(st.none(), ids),
        "tree_depth": st.one_of(st.integers(0, 64), U32),
        "vocab_fingerprint": st.one_of(st.just(ctx.fingerprint[:-1]), st.just(ctx.fingerprint.upper()),
                                       st.text(max_size=80)),
        "resume_token": st.one_of(st.binary(max_size=64), bank),
    }


_BY_TYPE = {FD.TYPE_UINT32: U32, FD.TYPE_UINT64: U64, FD.TYPE_FLOAT: FLOATS, FD.TYPE_DOUBLE: FLOATS,
            FD.TYPE_ENUM: ENUMS, FD.TYPE_STRING: st.text(max_size=80), FD.TYPE_BYTES: st.binary(max_size=300),
            FD.TYPE_BOOL: st.booleans(), FD.TYPE_INT32: st.integers(-(2**31), 2**31 - 1)}


def _leaf_fields(descriptor, prefix=()):
    """(path, FieldDescriptor) of every scalar or repeated-scalar field, through nested messages."""
    for f in descriptor.fields:
        if f.type == FD.TYPE_MESSAGE:
            yield from _leaf_fields(f.message_type, prefix + (f.name,))
        else:
            yield prefix + (f.name,), f


def _set_field(msg, path: tuple[str, ...], field, value) -> None:
    for name in path[:-1]:
        msg = getattr(msg, name)
    name = path[-1]
    if field.is_repeated:
        del getattr(msg, name)[:]
        getattr(msg, name).extend(value)
    elif value is None:
        msg.ClearField(name)
    else:
        setattr(msg, name, value)


def _oversized() -> pb.DeviceMessage:
    return pb.DeviceMessage(draft=pb.Draft(round_id=1, token_ids=[5], distributions=[bytes(MAX_MESSAGE_BYTES)]))


def _bad_metadata():
    """Credentials that must be refused: none, unknown token, wrong scheme, token mangled."""
    token = TOKENS[0]
    wrong = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40).filter(lambda t: t not in TOKENS)
    return st.one_of(
        st.just(()), wrong.map(lambda t: (("authorization", f"Bearer {t}"),)),
        st.just((("authorization", f"Basic {token}"),)), st.just((("authorization", token),)),
        st.just((("authorization", f"Bearer {token[:-1]}"),)), st.just((("x-authorization", f"Bearer {token}"),)))


def _field_sessions(ctx: Fuzz):
    overrides = _field_strategies(ctx)
    leaves = {kind: list(_leaf_fields(pb.DeviceMessage.DESCRIPTOR.fields_by_name[kind].message_type))
              for kind in pb.DeviceMessage.DESCRIPTOR.fields_by_name}
    ops = ["field"] * 4 + ["drop", "duplicate", "swap", "insert", "truncate", "empty", "oversized"]
    bad_metadata = _bad_metadata()
    recorded_messages = st.sampled_from([m for session in ctx.corpus for m in session])

    @st.composite
    def sessions(draw):
        recorded = draw(st.sampled_from(ctx.corpus))
        # A prefix of the recorded session, then its Close: a mutation's consequences show within a
        # round or two, and a shorter replay buys more inputs per second.
        cut = draw(st.integers(2, len(recorded) - 1))
        msgs = [pb.DeviceMessage.FromString(m) for m in recorded[:cut] + recorded[-1:]]
        for op in draw(st.lists(st.sampled_from(ops), min_size=1, max_size=4)):
            i = draw(st.integers(0, len(msgs)))  # a position; == len(msgs) appends
            if op == "field" and i < len(msgs) and leaves.get(_kind(msgs[i])):
                kind = _kind(msgs[i])
                path, field = draw(st.sampled_from(leaves[kind]))
                scalar = overrides.get(path[-1], _BY_TYPE[field.type])
                value = draw(scalar if path[-1] in overrides or not field.is_repeated
                             else st.lists(scalar, max_size=40))
                _set_field(getattr(msgs[i], kind), path, field, value)
            elif op == "drop" and i < len(msgs):
                del msgs[i]
            elif op == "duplicate" and msgs:
                copy = msgs[draw(st.integers(0, len(msgs) - 1))].SerializeToString()
                msgs.insert(i, pb.DeviceMessage.FromString(copy))
            elif op == "swap" and i < len(msgs):
                j = draw(st.integers(0, len(msgs) - 1))
                msgs[i], msgs[j] = msgs[j], msgs[i]
            elif op == "insert":  # any recorded message: a second Hello, a Prompt, a Residual...
                msgs.insert(i, pb.DeviceMessage.FromString(draw(recorded_messages)))
            elif op == "truncate":
                msgs = msgs[:i]
            elif op == "empty":
                msgs.insert(i, pb.DeviceMessage())
            elif op == "oversized" and draw(st.sampled_from(range(10))) == 3:  # rare: a megabyte per send
                msgs.insert(i, _oversized())
        bad_auth = draw(st.sampled_from(range(32))) == 17  # ~3% (st.integers is far from uniform)
        metadata = draw(bad_metadata) if bad_auth else AUTH_A
        return [m.SerializeToString() for m in msgs], metadata

    return sessions()


# ----------------------------------------------------------------------- strategies: part b (bytes)


@st.composite
def _mutated(draw, data: bytes, bank: list[bytes]) -> bytes:
    """1-4 byte-level mutations of ``data``."""
    for op in draw(st.lists(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "splice", "varint"]),
                            min_size=1, max_size=4)):
        n = len(data)
        i = draw(st.integers(0, n))
        if op == "flip" and i < n:
            data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
        elif op == "set" and i < n:
            value = draw(st.one_of(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]), st.integers(0, 255)))
            data = data[:i] + bytes([value]) + data[i + 1:]
        elif op == "truncate":
            data = data[:i]
        elif op == "insert":
            data = data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
        elif op == "delete":
            data = data[:i] + data[i + draw(st.integers(1, 16)):]
        elif op == "splice":
            other = draw(st.sampled_from(bank))
            data = data[:i] + other[draw(st.integers(0, len(other))):]
        elif op == "varint":  # an over-long or huge varint (lengths, counts, K)
            data = data[:i] + b"\xff" * draw(st.integers(1, 10)) + bytes([draw(st.integers(0, 0x7F))]) + data[i:]
    return data


def _byte_sessions(ctx: Fuzz):
    @st.composite
    def sessions(draw):
        raw = list(draw(st.sampled_from(ctx.corpus)))
        close = raw[-1]
        drafts = [i for i, m in enumerate(raw) if pb.DeviceMessage.FromString(m).HasField("draft")]
        if draw(st.booleans()):  # whole serialized messages; the session closes a round or two later
            hit = draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=2, unique=True))
            for i in hit:
                raw[i] = draw(_mutated(raw[i], ctx.bank))
            return raw[: max(hit) + 1 + draw(st.integers(0, 2))] + [close], None
        # One codec payload (or DSSD scalars) of one Draft; the session then closes after it.
        i = draw(st.sampled_from(drafts))
        msg = pb.DeviceMessage.FromString(raw[i])
        d = msg.draft
        if d.distributions:
            j = draw(st.integers(0, len(d.distributions) - 1))
            d.distributions[j] = draw(_mutated(d.distributions[j], ctx.bank))
        else:
            d.dssd_scalars = draw(_mutated(d.dssd_scalars, ctx.bank))
        return raw[:i] + [msg.SerializeToString(), close], i

    return sessions()


# ------------------------------------------------------------------- parts c (hijack), d (silent)


def _open_stream(ctx: Fuzz, metadata=AUTH_A):
    """A stream kept open: (put bytes or None to half-close, response iterator)."""
    requests: queue.Queue = queue.Queue()
    responses = ctx.call(iter(requests.get, None), timeout=CALL_TIMEOUT_S * 2, metadata=metadata)
    return requests.put, responses


def _hijack(ctx: Fuzz, rounds: int) -> None:
    """Another principal, or the owner without the right secret, tries to resume a live session:
    refused, and the victim's next verdict is exactly an undisturbed session's."""
    session = ctx.corpus[[m for m, t, e in CORPUS].index(Mode.TSLT)]  # greedy TSLT chain
    hello, prompt, draft = session[:3]
    close = pb.DeviceMessage(close=pb.Close()).SerializeToString()
    reference = ctx.send([hello, prompt, draft, close]).replies[1]
    for r in range(rounds):
        put, responses = _open_stream(ctx)
        put(hello)
        welcome = pb.EdgeMessage.FromString(next(responses)).welcome
        sid, token = welcome.session_id, welcome.resume_token
        put(prompt)
        flipped = bytes([token[0] ^ (1 << (r % 8))]) + token[1:]
        attempts = [(AUTH_B, sid, token), (AUTH_A, sid, bytes(len(token))), (AUTH_A, sid, b""),
                    (AUTH_A, sid, token[:-1]), (AUTH_A, sid, flipped), (AUTH_B, sid, b""), ((), sid, token),
                    (AUTH_A, sid.upper(), token), (AUTH_A, sid + " ", token)]
        for metadata, resume_id, resume_token in attempts:
            msg = pb.DeviceMessage.FromString(hello)
            msg.hello.resume_session_id, msg.hello.resume_token = resume_id, resume_token
            chunks = [msg.SerializeToString(), prompt, close]
            out = ctx.send(chunks, metadata)
            malformed = not SESSION_ID_RE.fullmatch(resume_id) or len(resume_token) != RESUME_TOKEN_BYTES
            if malformed and metadata in (AUTH_A, AUTH_B):  # not an id or token of this protocol's form
                _check(ctx, "hijack", chunks, out, metadata, allowed=frozenset({grpc.StatusCode.INVALID_ARGUMENT}))
            elif resume_id != sid:  # an id nobody holds: a fresh session of the caller's own
                _check(ctx, "hijack", chunks, out, metadata, allowed=frozenset({grpc.StatusCode.OK}))
                assert out.replies[0].welcome.session_id != sid and not out.replies[0].welcome.resumed
            elif metadata == AUTH_A or metadata == AUTH_B:
                _check(ctx, "hijack", chunks, out, metadata, allowed=frozenset({grpc.StatusCode.PERMISSION_DENIED}))
            else:
                _check(ctx, "hijack", chunks, out, metadata)
        put(draft)
        verdict = pb.EdgeMessage.FromString(next(responses))
        put(close)
        put(None)
        assert list(responses) == []
        verdict.verdict.ClearField("timings")
        reference.verdict.ClearField("timings")
        assert verdict == reference, "a refused resume disturbed the victim's session"


def _silent(ctx: Fuzz, n: int) -> list[threading.Thread]:
    """Clients that open a session (Hello, and Prompt for half of them) and then say nothing."""
    hello, prompt = ctx.corpus[0][:2]
    threads = []
    for i in range(n):
        def run(chunks=[hello, prompt][: 1 + i % 2]):
            put, responses = _open_stream(ctx)
            for c in chunks:
                put(c)
            t0 = time.monotonic()
            try:
                for _ in responses:
                    pass
                out = Outcome(grpc.StatusCode.OK, "", [], time.monotonic() - t0)
            except grpc.RpcError as exc:
                out = Outcome(exc.code(), exc.details(), [], time.monotonic() - t0)
            finally:
                put(None)
            ctx.count("silent", out)
            assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in out.details, out
            assert out.seconds < IDLE_TIMEOUT_S + 10, out
        thread = threading.Thread(target=_raising(run))
        thread.start()
        threads.append(thread)
    return threads


def _raising(fn):
    """A thread target that keeps its exception for the join."""
    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by _join
            threading.current_thread().error = exc
    return run


def _join(threads) -> None:
    for t in threads:
        t.join(IDLE_TIMEOUT_S + 30)
        assert not t.is_alive(), "a silent client was never cut off"
        if getattr(t, "error", None):
            raise t.error


# ------------------------------------------------------------------------------------ driver


def _fuzz_all(ctx: Fuzz, examples: int, hijack_rounds: int, silent: int, derandomize: bool) -> None:
    cfg = settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
                   phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))

    @cfg
    @given(case=_field_sessions(ctx))
    def fields(case):
        chunks, metadata = case
        _check(ctx, "fields", chunks, ctx.send(chunks, metadata), metadata)

    @cfg
    @given(case=_byte_sessions(ctx))
    def bytes_(case):
        chunks, payload_draft = case
        out = ctx.send(chunks)
        # A mutated payload in an otherwise valid session: a verdict, or INVALID_ARGUMENT.
        allowed = None if payload_draft is None else frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT})
        _check(ctx, "bytes", chunks, out, allowed=allowed)

    threads = _silent(ctx, silent)
    fields()
    bytes_()
    _hijack(ctx, hijack_rounds)
    _join(threads)


def _run(ctx: Fuzz, examples: int, hijack_rounds: int, silent: int, derandomize: bool) -> None:
    ctx.statuses.clear()
    t0 = time.monotonic()

    async def main():
        stop = asyncio.Event()
        good = asyncio.create_task(_good_loop(ctx, stop))
        try:
            await asyncio.to_thread(_fuzz_all, ctx, examples, hijack_rounds, silent, derandomize)
        finally:
            stop.set()
        alongside = await good
        async with open_channel(ctx.edge.address) as channel:  # and afterwards, every mode again
            after = [(mode, await _good_session(ctx, channel, mode)) for mode in Mode]
        return alongside, after

    alongside, after = asyncio.run(main())
    elapsed = time.monotonic() - t0
    for mode, tokens in alongside + after:
        assert tokens == ctx.expected, f"{mode.value}: {tokens} != {ctx.expected}"
    deadline = time.monotonic() + RESUME_WINDOW_S + 10
    while ctx.edge.sessions_active() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ctx.edge.sessions_active() == 0, "sessions left behind on the edge"
    assert ctx.edge.alive() and ctx.edge.log_counts["session failed (INTERNAL)"] == 0
    _report(ctx, elapsed, len(alongside))
    assert ctx.inputs("fields") >= examples and ctx.inputs("bytes") >= examples


def _report(ctx: Fuzz, elapsed: float, good_runs: int) -> None:
    print(f"\nfuzz: {ctx.inputs()} inputs in {elapsed:.1f} s ({ctx.stream_seconds:.1f} s inside streams, "
          f"slowest {ctx.slowest:.2f} s), {good_runs} good sessions alongside")
    for part in ("fields", "bytes", "hijack", "silent"):
        codes = {code: n for (p, code), n in sorted(ctx.statuses.items()) if p == part}
        print(f"  {part:7s} {ctx.inputs(part):6d}  {codes}")
    print(f"  edge log: {dict(ctx.edge.log_counts)}")


def test_fuzz_short(fuzz) -> None:
    _run(fuzz, SHORT_EXAMPLES, hijack_rounds=2, silent=2, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_long(fuzz) -> None:
    _run(fuzz, LONG_EXAMPLES, hijack_rounds=30, silent=8, derandomize=False)
