"""Protobuf <-> domain conversion. The only module besides the servicer and client that imports ``*_pb2``.

Every ``*_from_pb`` function validates what protobuf cannot (enums, ranges) and raises ``ValueError``
with a message that the servicer turns into ``INVALID_ARGUMENT``.
"""
from __future__ import annotations

import itertools
import math

from specdec.common import protocol as P
from specdec.common.adjust import LogitAdjust
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob, descending
from specdec.common.idpack import pack_ids, unpack_ids
from specdec.common.pb import speculative_pb2 as pb
from specdec.common.modes import Mode
from specdec.common.settings import setting_names

_MODE_TO_PB = {
    Mode.DENSE: pb.MODE_DENSE,
    Mode.TSLT: pb.MODE_TSLT,
    Mode.KSQS: pb.MODE_KSQS,
    Mode.CSQS: pb.MODE_CSQS,
    Mode.DSSD: pb.MODE_DSSD,
    Mode.NONE: pb.MODE_NONE,
    Mode.GUMBEL: pb.MODE_GUMBEL,
}
_PB_TO_MODE = {v: k for k, v in _MODE_TO_PB.items()}
_DTYPE_TO_PB = {"fp32": pb.DENSE_DTYPE_FP32, "fp16": pb.DENSE_DTYPE_FP16, "bf16": pb.DENSE_DTYPE_BF16}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}


def _mode_from_pb(value: int) -> Mode:
    if value not in _PB_TO_MODE:
        raise ValueError(f"unknown or unspecified draft mode {value}")
    return _PB_TO_MODE[value]


def _dtype_from_pb(value: int) -> str:
    if value not in _PB_TO_DTYPE:
        raise ValueError(f"unknown dense dtype {value}")
    return _PB_TO_DTYPE[value]


# Draft settings convert field by field (the proto message has the table's field names); only the
# fields whose wire type differs from the domain's need a converter here. Float settings travel as
# proto `float` (float32): the edge reads none of them for verification (they steer the device's
# C-SQS threshold and TSLT's top-p encoding; the payload says what was sent).
_SETTING_TO_PB = {"mode": lambda m: _MODE_TO_PB[m], "dense_dtype": lambda d: _DTYPE_TO_PB[d], "tree": list}
_SETTING_FROM_PB = {"mode": _mode_from_pb, "dense_dtype": _dtype_from_pb, "tree": tuple}


def settings_to_pb(s: P.DraftSettings) -> pb.DraftSettings:
    values = {name: getattr(s, name) for name in setting_names()}
    return pb.DraftSettings(**{k: _SETTING_TO_PB.get(k, _same)(v) for k, v in values.items()})


def settings_from_pb(m: pb.DraftSettings, mode: int | None = None) -> P.DraftSettings:
    """``mode``: the Hello's own mode field, for devices that leave DraftSettings.mode unset."""
    raw = {name: getattr(m, name) for name in setting_names()}
    if raw["mode"] == pb.MODE_UNSPECIFIED and mode is not None:
        raw["mode"] = mode
    return P.DraftSettings(**{k: _SETTING_FROM_PB.get(k, _same)(v) for k, v in raw.items()})


def _same(value):
    return value


def hello_to_pb(h: P.Hello) -> pb.DeviceMessage:
    return pb.DeviceMessage(hello=pb.Hello(
        protocol_version=h.protocol_version, mode=_MODE_TO_PB[h.draft.mode],
        vocab_fingerprint=h.vocab_fingerprint, vocab_size=h.vocab_size, temperature=h.temperature,
        target_top_p=h.target_top_p, target_top_k=h.target_top_k, draft=settings_to_pb(h.draft),
        seed=h.seed, max_new_tokens=h.max_new_tokens, resume_session_id=h.resume_session_id,
        resume_token=h.resume_token, target_fingerprint=h.target_fingerprint, wants_end=h.wants_end,
        target_min_p=h.target_min_p, adjust=adjust_to_pb(h.adjust), grammar=grammar_to_pb(h.grammar),
        logprobs=None if h.logprobs == NO_LOGPROBS else h.logprobs, continues_late=h.continues_late,
        continues_late_edge_only=h.continues_late_edge_only, stop_ids=list(h.stop_ids), ignore_eos=h.ignore_eos,
    ))


_GRAMMAR_TO_PB = {GrammarKind.JSON_SCHEMA: pb.GRAMMAR_KIND_JSON_SCHEMA, GrammarKind.JSON_OBJECT: pb.GRAMMAR_KIND_JSON_OBJECT,
                  GrammarKind.REGEX: pb.GRAMMAR_KIND_REGEX, GrammarKind.LARK: pb.GRAMMAR_KIND_LARK}
_PB_TO_GRAMMAR = {v: k for k, v in _GRAMMAR_TO_PB.items()}


def grammar_to_pb(g: Grammar | None) -> pb.Grammar | None:
    return None if g is None else pb.Grammar(kind=_GRAMMAR_TO_PB[g.kind], source=g.source)


def grammar_from_pb(m: pb.Hello) -> Grammar | None:
    """The Hello's grammar, or None; ValueError on an unknown kind."""
    if not m.HasField("grammar"):
        return None
    if m.grammar.kind not in _PB_TO_GRAMMAR:
        raise ValueError(f"unknown grammar kind {m.grammar.kind}")
    return Grammar(_PB_TO_GRAMMAR[m.grammar.kind], m.grammar.source)


def adjust_to_pb(a: LogitAdjust) -> pb.LogitAdjust:
    return pb.LogitAdjust(bias_ids=[i for i, _ in a.logit_bias], bias_values=[b for _, b in a.logit_bias],
                          repetition_penalty=0.0 if a.repetition_penalty == 1.0 else a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty)


def adjust_from_pb(m: pb.LogitAdjust) -> LogitAdjust:
    """ValueError on a malformed one (ids and values of different lengths; what LogitAdjust.check refuses)."""
    if len(m.bias_ids) != len(m.bias_values):
        raise ValueError(f"logit bias: {len(m.bias_ids)} ids, {len(m.bias_values)} values")
    adjust = LogitAdjust(tuple(zip(m.bias_ids, m.bias_values)), repetition_penalty=m.repetition_penalty or 1.0,
                         presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty)
    adjust.check()
    return adjust


def hello_from_pb(m: pb.Hello) -> P.Hello:
    return P.Hello(
        protocol_version=m.protocol_version,
        vocab_fingerprint=m.vocab_fingerprint, vocab_size=m.vocab_size, temperature=m.temperature,
        target_top_p=m.target_top_p, target_top_k=m.target_top_k,
        draft=settings_from_pb(m.draft, mode=m.mode),
        seed=m.seed, max_new_tokens=m.max_new_tokens, resume_session_id=m.resume_session_id,
        resume_token=m.resume_token, target_fingerprint=m.target_fingerprint, wants_end=m.wants_end,
        target_min_p=m.target_min_p, adjust=adjust_from_pb(m.adjust), grammar=grammar_from_pb(m),
        logprobs=m.logprobs if m.HasField("logprobs") else NO_LOGPROBS, continues_late=m.continues_late,
        continues_late_edge_only=m.continues_late_edge_only, stop_ids=tuple(m.stop_ids), ignore_eos=m.ignore_eos,
    )


def welcome_to_pb(w: P.Welcome) -> pb.EdgeMessage:
    msg = pb.Welcome(
        session_id=w.session_id, protocol_version=w.protocol_version, model_name=w.model_name,
        vocab_size=w.vocab_size, max_context=w.max_context, max_draft_len=w.max_draft_len,
        max_k=w.max_k, resume_token=w.resume_token, resumed=w.resumed, dssd_max_samples=w.dssd_max_samples,
        target_fingerprint=w.target_fingerprint, edge_name=w.edge_name,
        forward_cost=[pb.CostPoint(tokens=t, seconds=sec) for t, sec in w.forward_cost],
        modes=[_MODE_TO_PB[m] for m in w.modes], adjusts_law=w.adjusts_law, continues_late=w.continues_late,
        continues_late_edge_only=w.continues_late_edge_only, ignores_eos=w.ignores_eos,
        token_probs=w.token_probs,
    )
    if w.draft_len_hint is not None:
        msg.draft_len_hint = w.draft_len_hint
    return pb.EdgeMessage(welcome=msg)


def welcome_from_pb(m: pb.Welcome) -> P.Welcome:
    return P.Welcome(
        session_id=m.session_id, protocol_version=m.protocol_version, model_name=m.model_name,
        vocab_size=m.vocab_size, max_context=m.max_context, max_draft_len=m.max_draft_len,
        max_k=m.max_k, resume_token=m.resume_token, resumed=m.resumed, dssd_max_samples=m.dssd_max_samples,
        target_fingerprint=m.target_fingerprint, edge_name=m.edge_name,
        forward_cost=tuple((c.tokens, c.seconds) for c in m.forward_cost),
        # a mode this device does not know is one it never sends: left out
        modes=tuple(_PB_TO_MODE[v] for v in m.modes if v in _PB_TO_MODE),
        draft_len_hint=m.draft_len_hint if m.HasField("draft_len_hint") else None,
        adjusts_law=m.adjusts_law, continues_late=m.continues_late,
        continues_late_edge_only=m.continues_late_edge_only, ignores_eos=m.ignores_eos,
        token_probs=m.token_probs,
    )


def prompt_to_pb(p: P.Prompt) -> pb.DeviceMessage:
    return pb.DeviceMessage(prompt=pb.Prompt(token_ids=list(p.token_ids), prompt_len=p.prompt_len))


def prompt_from_pb(m: pb.Prompt) -> P.Prompt:
    return P.Prompt(token_ids=tuple(m.token_ids), prompt_len=m.prompt_len)


def draft_to_pb(d: P.DraftBlock) -> pb.DeviceMessage:
    msg = pb.Draft(round_id=d.round_id, distributions=list(d.distributions), dssd_scalars=d.dssd_scalars,
                   tree_depth=d.tree_depth, sent_ahead=d.sent_ahead, run_ahead_ms=d.run_ahead_ms, start=d.start,
                   token_probs=d.token_probs)
    if d.id_bits:
        msg.packed_ids, msg.id_bits = pack_ids(d.token_ids, d.id_bits), d.id_bits
    else:
        msg.token_ids.extend(d.token_ids)
    if d.correction_token is not None:
        msg.correction_token = d.correction_token
    if d.settings is not None:
        msg.settings.CopyFrom(settings_to_pb(d.settings))
    return pb.DeviceMessage(draft=msg)


def draft_from_pb(m: pb.Draft) -> P.DraftBlock:
    if m.id_bits and m.token_ids:
        raise ValueError("a Draft carries its ids either packed or as token_ids, not both")
    if m.packed_ids and not m.id_bits:
        raise ValueError("packed_ids without id_bits")
    return P.DraftBlock(
        round_id=m.round_id, token_ids=unpack_ids(m.packed_ids, m.id_bits) if m.id_bits else tuple(m.token_ids),
        distributions=tuple(m.distributions), id_bits=m.id_bits,
        dssd_scalars=m.dssd_scalars,
        correction_token=m.correction_token if m.HasField("correction_token") else None,
        tree_depth=m.tree_depth,
        settings=settings_from_pb(m.settings) if m.HasField("settings") else None,
        sent_ahead=m.sent_ahead, run_ahead_ms=m.run_ahead_ms, start=m.start, token_probs=m.token_probs,
    )


def residual_request_to_pb(r: P.ResidualRequest) -> pb.DeviceMessage:
    return pb.DeviceMessage(residual_request=pb.ResidualRequest(round_id=r.round_id, whole=r.whole))


def device_message_to_pb(msg: P.DraftBlock | P.ResidualRequest) -> pb.DeviceMessage:
    """A mid-session message of the device (a round's Draft or a DSSD fallback's request)."""
    if isinstance(msg, P.DraftBlock):
        return draft_to_pb(msg)
    if isinstance(msg, P.ResidualRequest):
        return residual_request_to_pb(msg)
    raise TypeError(f"not a mid-session device message: {type(msg).__name__}")


def close_to_pb() -> pb.DeviceMessage:
    return pb.DeviceMessage(close=pb.Close())


def verdict_to_pb(v: P.Verdict) -> pb.EdgeMessage:
    msg = pb.Verdict(
        round_id=v.round_id, num_accepted=v.num_accepted, reject_samples=list(v.reject_samples),
        reject_sample_probs=list(v.reject_sample_probs), accepted_nodes=list(v.accepted_nodes),
        more=v.more, ahead=v.ahead, superseded=v.superseded,
        timings=pb.EdgeTimings(verify_seconds=v.verify_seconds, queue_seconds=v.queue_seconds,
                               decode_seconds=v.decode_seconds),
    )
    if v.next_token is not None:
        msg.next_token = v.next_token
    if v.draft_len_hint is not None:
        msg.draft_len_hint = v.draft_len_hint
    if v.logprobs:
        _logprobs_to_pb(v.logprobs, msg)
    return pb.EdgeMessage(verdict=msg)


def _logprobs_to_pb(logprobs: tuple[TokenLogprob, ...], msg: pb.Verdict) -> None:
    """Flat: each token's top list (N entries, or N - 1 when the token itself is among them: ``in_top``)
    padded to that length with (0, -inf), its ids ascending and sent as differences (varints of the
    gaps: ~2 bytes each where whole ids of a 49k vocabulary take 3)."""
    width = max(len(t.top) + t.in_top for t in logprobs)
    msg.logprobs.extend(t.logprob for t in logprobs)
    if not width:  # no top asked: the own log-probabilities alone
        return
    msg.top_in.extend(t.in_top for t in logprobs)
    for t in logprobs:
        top = sorted(t.top)
        ids = [i for i, _ in top]
        pad = width - t.in_top - len(top)
        msg.top_ids.extend([b - a for a, b in zip([0] + ids, ids)] + [0] * pad)
        msg.top_logprobs.extend([lp for _, lp in top] + [-math.inf] * pad)


def _logprobs_from_pb(m: pb.Verdict) -> tuple[TokenLogprob, ...]:
    """ValueError unless the top lists split among the tokens; each list back in descending order."""
    n = len(m.logprobs)
    if not n:
        return ()
    flags = list(m.top_in) or [False] * n
    if len(flags) != n or len(m.top_ids) != len(m.top_logprobs) or (len(m.top_ids) + sum(flags)) % n:
        raise ValueError(f"verdict logprobs: {len(m.top_ids)} top ids, {len(m.top_logprobs)} values, "
                         f"{len(m.top_in)} flags for {n} tokens")
    width, out, at = (len(m.top_ids) + sum(flags)) // n, [], 0
    for lp, in_top in zip(m.logprobs, flags):
        k = width - in_top
        ids = list(itertools.accumulate(m.top_ids[at:at + k]))
        top = [(i, v) for i, v in zip(ids, m.top_logprobs[at:at + k]) if v > -math.inf]
        out.append(TokenLogprob(lp, descending(top), bool(in_top)))
        at += k
    return tuple(out)


def verdict_from_pb(m: pb.Verdict) -> P.Verdict:
    return P.Verdict(
        round_id=m.round_id, num_accepted=m.num_accepted,
        next_token=m.next_token if m.HasField("next_token") else None,
        reject_samples=tuple(m.reject_samples), reject_sample_probs=tuple(m.reject_sample_probs),
        accepted_nodes=tuple(m.accepted_nodes), more=m.more, verify_seconds=m.timings.verify_seconds,
        queue_seconds=m.timings.queue_seconds, decode_seconds=m.timings.decode_seconds,
        draft_len_hint=m.draft_len_hint if m.HasField("draft_len_hint") else None,
        logprobs=_logprobs_from_pb(m), ahead=m.ahead, superseded=m.superseded,
    )


_HEAD_FIELDS = ("head_ids", "head_probs", "tail_samples", "tail_sample_probs")


def residual_to_pb(r: P.ResidualReply) -> pb.EdgeMessage:
    heads = {name: list(getattr(r, name)) for name in _HEAD_FIELDS}
    return pb.EdgeMessage(residual=pb.ResidualReply(round_id=r.round_id, target_probs=r.target_probs,
                                                    tail_mass=r.tail_mass, **heads))


def residual_from_pb(m: pb.ResidualReply) -> P.ResidualReply:
    heads = {name: tuple(getattr(m, name)) for name in _HEAD_FIELDS}
    return P.ResidualReply(round_id=m.round_id, target_probs=m.target_probs, tail_mass=m.tail_mass, **heads)


def device_message_from_pb(m: pb.DeviceMessage):
    """Return the domain object carried by a DeviceMessage (ValueError if empty)."""
    kind = m.WhichOneof("kind")
    converters = {
        "hello": lambda: hello_from_pb(m.hello),
        "prompt": lambda: prompt_from_pb(m.prompt),
        "draft": lambda: draft_from_pb(m.draft),
        "residual_request": lambda: P.ResidualRequest(round_id=m.residual_request.round_id,
                                                      whole=m.residual_request.whole),
        "close": lambda: P.Close(),
    }
    if kind is None:
        raise ValueError("empty DeviceMessage")
    return converters[kind]()


def end_to_pb(e: P.End) -> pb.EdgeMessage:
    return pb.EdgeMessage(end=pb.End(code=e.code, details=e.details, reason=e.reason))


def end_from_pb(m: pb.End) -> P.End:
    return P.End(code=m.code, details=m.details, reason=m.reason)


def edge_message_from_pb(m: pb.EdgeMessage):
    kind = m.WhichOneof("kind")
    converters = {
        "welcome": lambda: welcome_from_pb(m.welcome),
        "verdict": lambda: verdict_from_pb(m.verdict),
        "residual": lambda: residual_from_pb(m.residual),
        "end": lambda: end_from_pb(m.end),
    }
    if kind is None:
        raise ValueError("empty EdgeMessage")
    return converters[kind]()
