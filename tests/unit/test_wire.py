"""Wire conversions of the DSSD fallback messages (settings' round trips: test_settings.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.codecs import encode_target_probs
from specdec.common.pb import speculative_pb2 as pb
from specdec.common.modes import Mode
from specdec.common.verification import DssdHead, dssd_edge_head


def _through_wire(reply: P.ResidualReply) -> P.ResidualReply:
    raw = wire.residual_to_pb(reply).SerializeToString()
    return wire.edge_message_from_pb(pb.EdgeMessage.FromString(raw))


def test_residual_request_round_trip_keeps_whole() -> None:
    for whole in (False, True):
        raw = wire.residual_request_to_pb(P.ResidualRequest(7, whole=whole)).SerializeToString()
        assert wire.device_message_from_pb(pb.DeviceMessage.FromString(raw)) == P.ResidualRequest(7, whole=whole)


def test_head_reply_round_trip_is_bit_exact() -> None:
    p = torch.softmax(torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3, 0)
    h = dssd_edge_head(p, 16, 8, torch.Generator().manual_seed(1))
    reply = P.ResidualReply(3, **h.to_values())
    back = _through_wire(reply)
    assert back == reply and back.is_head  # float64 and ids exactly: the device's law depends on them
    again = DssdHead.from_values(back)
    for name in ("head_ids", "head_probs", "tail_samples", "tail_sample_probs"):
        assert torch.equal(getattr(again, name), getattr(h, name)), name
    assert again.tail_mass == h.tail_mass


def test_whole_reply_of_an_old_edge_reads_as_whole() -> None:
    p = torch.full((10,), 0.1, dtype=torch.float64)
    back = _through_wire(P.ResidualReply(2, target_probs=encode_target_probs(p)))
    assert not back.is_head and back.target_probs == encode_target_probs(p) and back.tail_mass == 0.0


def test_welcome_round_trips_with_every_field() -> None:
    """Paired transform: a Welcome with every field set survives protobuf and back, the edge's
    calibrated cost curve and its first advice included (an advice of 0 too: edge-only); an edge
    before them leaves the curve empty and gives no advice."""
    welcome = P.Welcome(session_id="s1", model_name="m", vocab_size=49152, max_context=2048, max_draft_len=16,
                        max_k=512, resume_token=b"\x01\x02", resumed=True, dssd_max_samples=32,
                        target_fingerprint="fp", edge_name="edge-a",
                        forward_cost=((1, 0.0071), (8, 0.0072), (256, 0.0125)), modes=tuple(Mode), draft_len_hint=3,
                        adjusts_law=True, continues_late=True, continues_late_edge_only=True, ignores_eos=True,
                        token_probs=True)
    for w in (welcome, replace(welcome, draft_len_hint=0), replace(welcome, draft_len_hint=None)):
        msg = pb.EdgeMessage.FromString(wire.welcome_to_pb(w).SerializeToString())
        assert wire.welcome_from_pb(msg.welcome) == w
    old = pb.Welcome(session_id="s1", model_name="m", vocab_size=8, max_context=64, max_draft_len=4, max_k=8)
    assert wire.welcome_from_pb(old).forward_cost == () and wire.welcome_from_pb(old).draft_len_hint is None
    assert not wire.welcome_from_pb(old).continues_late  # an edge before the field supersedes late rounds
    assert not wire.welcome_from_pb(old).continues_late_edge_only
    assert not wire.welcome_from_pb(old).ignores_eos  # an edge before the field ends rounds at EOS
    assert not wire.welcome_from_pb(old).token_probs  # ... and sends no p with an edge-only round's tokens


def test_a_hello_s_late_rounds_stop_ids_and_ignore_eos_survive_the_wire() -> None:
    from specdec.common.settings import DraftSettings
    hello = P.Hello(vocab_fingerprint="fp", vocab_size=8, temperature=0.0, draft=DraftSettings(mode=Mode.TSLT),
                    wants_end=True, continues_late=True, continues_late_edge_only=True, stop_ids=(2, 7),
                    ignore_eos=True)
    for h in (hello, replace(hello, continues_late=False, continues_late_edge_only=False, stop_ids=(), ignore_eos=False)):
        msg = pb.DeviceMessage.FromString(wire.hello_to_pb(h).SerializeToString())
        back = wire.device_message_from_pb(msg)  # (the CSQS floats are float32 on the wire)
        assert (back.continues_late, back.continues_late_edge_only, back.stop_ids, back.wants_end, back.ignore_eos) == (
            h.continues_late, h.continues_late_edge_only, h.stop_ids, True, h.ignore_eos)


# --- gumbel rounds: ids only, packed ---------------------------------------------------------------

def _draft_through_wire(block: P.DraftBlock) -> tuple[P.DraftBlock, int]:
    msg = wire.draft_to_pb(block)
    return wire.device_message_from_pb(pb.DeviceMessage.FromString(msg.SerializeToString())), msg.ByteSize()


def test_a_gumbel_draft_carries_packed_ids_and_nothing_else() -> None:
    from specdec.common.idpack import id_bits
    from specdec.common.modes import Mode
    from specdec.common.settings import DraftSettings
    ids = (49151, 0, 16384, 40000)
    block = P.DraftBlock(round_id=3, token_ids=ids, id_bits=id_bits(49152))
    back, size = _draft_through_wire(block)
    assert back == block
    m = wire.draft_to_pb(block).draft
    assert len(m.packed_ids) == 2 * len(ids) and not m.token_ids and not m.distributions
    assert size <= 4 * len(ids) + 4  # whole message: 8 bytes of ids, their length, the width, round id, framing
    with_settings, _ = _draft_through_wire(P.DraftBlock(round_id=1, token_ids=ids, id_bits=16,
                                                        settings=DraftSettings(mode=Mode.GUMBEL, draft_len=4)))
    assert with_settings.settings.mode is Mode.GUMBEL and with_settings.token_ids == ids


def test_an_edge_only_draft_sent_ahead_and_asking_for_p_keeps_its_marks() -> None:
    from specdec.common.settings import DraftSettings
    block = P.DraftBlock(round_id=4, token_ids=(), settings=DraftSettings(mode=Mode.NONE, edge_tokens=8),
                         sent_ahead=True, token_probs=True)
    back, _ = _draft_through_wire(block)
    assert back.sent_ahead and (back.round_id, back.token_ids, back.settings.edge_tokens) == (4, (), 8)
    assert back.token_probs
    assert not _draft_through_wire(replace(block, sent_ahead=False))[0].sent_ahead
    assert not _draft_through_wire(replace(block, token_probs=False))[0].token_probs


def test_a_round_s_start_and_run_ahead_and_the_verdicts_marks_survive_the_wire() -> None:
    block = P.DraftBlock(round_id=5, token_ids=(3, 4), id_bits=8, run_ahead_ms=350, start=1234)
    back, _ = _draft_through_wire(block)
    assert back == block and (back.run_ahead_ms, back.start) == (350, 1234)
    assert _draft_through_wire(replace(block, run_ahead_ms=0, start=0))[0] == replace(block, run_ahead_ms=0, start=0)
    for verdict in (P.Verdict(round_id=4, num_accepted=0, next_token=17, ahead=True),
                    P.Verdict(round_id=5, num_accepted=0, next_token=None, superseded=True),
                    P.Verdict(round_id=5, num_accepted=2, next_token=9)):
        back = wire.edge_message_from_pb(pb.EdgeMessage.FromString(wire.verdict_to_pb(verdict).SerializeToString()))
        assert back == verdict


def test_a_draft_with_ids_both_ways_or_packed_without_width_is_refused() -> None:
    import pytest
    both = pb.Draft(round_id=1, token_ids=[1], packed_ids=b"\x01", id_bits=8)
    with pytest.raises(ValueError, match="not both"):
        wire.draft_from_pb(both)
    with pytest.raises(ValueError, match="without id_bits"):
        wire.draft_from_pb(pb.Draft(round_id=1, packed_ids=b"\x01"))
    with pytest.raises(ValueError):
        wire.draft_from_pb(pb.Draft(round_id=1, packed_ids=b"\x01\xff", id_bits=12))  # padding set


def test_an_edge_refuses_a_mode_it_does_not_know_with_a_clear_error() -> None:
    """What an edge from before mode gumbel does with MODE_GUMBEL (7), shown with a number this one
    does not know: INVALID_ARGUMENT naming the mode, in the Hello or in a round's settings."""
    import pytest
    unknown = max(pb.Mode.values()) + 1
    with pytest.raises(ValueError, match=f"unknown or unspecified draft mode {unknown}"):
        wire.draft_from_pb(pb.Draft(round_id=1, token_ids=[1], settings=pb.DraftSettings(mode=unknown)))


def test_welcome_lists_the_modes_an_edge_verifies() -> None:
    from specdec.common.modes import Mode
    base = dict(session_id="s", model_name="m", vocab_size=8, max_context=64, max_draft_len=4, max_k=8)
    new = P.Welcome(**base, modes=tuple(Mode))
    back = wire.welcome_from_pb(wire.welcome_to_pb(new).welcome)
    assert back == new and back.verifies(Mode.GUMBEL)
    old = wire.welcome_from_pb(pb.Welcome(**base))  # an edge before the field
    assert old.modes == () and not old.verifies(Mode.GUMBEL) and old.verifies(Mode.DSSD) and old.verifies(Mode.NONE)
    future = pb.Welcome(**base, modes=[pb.MODE_TSLT, max(pb.Mode.values()) + 1])  # a mode this device does not know
    assert wire.welcome_from_pb(future).modes == (Mode.TSLT,)
