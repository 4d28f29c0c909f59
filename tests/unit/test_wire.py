"""Wire conversions of the DSSD fallback messages (settings' round trips: test_settings.py)."""
from __future__ import annotations

import torch

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.codecs import encode_target_probs
from specdec.common.pb import speculative_pb2 as pb
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
    calibrated cost curve included; an edge before it leaves the curve empty."""
    welcome = P.Welcome(session_id="s1", model_name="m", vocab_size=49152, max_context=2048, max_draft_len=16,
                        max_k=512, resume_token=b"\x01\x02", resumed=True, dssd_max_samples=32,
                        target_fingerprint="fp", edge_name="edge-a",
                        forward_cost=((1, 0.0071), (8, 0.0072), (256, 0.0125)))
    msg = pb.EdgeMessage.FromString(wire.welcome_to_pb(welcome).SerializeToString())
    assert wire.welcome_from_pb(msg.welcome) == welcome
    old = pb.Welcome(session_id="s1", model_name="m", vocab_size=8, max_context=64, max_draft_len=4, max_k=8)
    assert wire.welcome_from_pb(old).forward_cost == ()
