"""The draft-settings table (common/settings.py) and everything derived from it: the CLI flags, the
OpenAI `specdec` object, the wire, the edge's checks, and per-round settings on the wire."""
from __future__ import annotations

import dataclasses

import pytest

from specdec.common import settings as S
from specdec.common import wire
from specdec.common.modes import Mode
from specdec.common.pb import speculative_pb2 as pb
from specdec.common.protocol import DraftBlock, Hello
from specdec.device import openai_schema
from specdec.device.cli import build_parser, build_serve_parser, config_from_args


def test_every_setting_is_a_proto_field_of_the_same_name() -> None:
    """Adding a row to the table without its proto field (or the reverse) fails here."""
    proto = {f.name for f in pb.DraftSettings.DESCRIPTOR.fields}
    assert proto == set(S.setting_names())


def test_wire_round_trip_of_every_setting() -> None:
    s = S.DraftSettings(mode=Mode.KSQS, draft_len=7, bit_budget=3000, top_k=9, top_p=0.5, lattice=77,
                        dense_dtype="bf16", csqs_alpha=0.25, csqs_eta=0.5, csqs_beta0=0.125, max_k=33,
                        dssd_samples=5, tree=(3, 1), coupled_bonus=False)  # floats exact in float32
    assert wire.settings_from_pb(wire.settings_to_pb(s)) == s
    assert {f.name for f in dataclasses.fields(s)} == set(S.setting_names())


def test_old_device_hello_without_settings_mode_uses_hello_mode() -> None:
    """A device from before DraftSettings.mode sets only Hello.mode: the edge reads that."""
    m = pb.Hello(protocol_version=1, mode=pb.MODE_DSSD, vocab_fingerprint="f", vocab_size=8,
                 draft=pb.DraftSettings(draft_len=3, top_k=4, lattice=10, dense_dtype=pb.DENSE_DTYPE_FP16,
                                        max_k=8, dssd_samples=2))
    assert wire.hello_from_pb(m).draft.mode is Mode.DSSD


def test_a_round_carries_its_settings_only_when_they_differ() -> None:
    same = DraftBlock(round_id=1, token_ids=(1, 2))
    exact = {"csqs_alpha": 0.25, "csqs_eta": 0.5, "csqs_beta0": 0.125}  # float settings travel as float32
    other = DraftBlock(round_id=2, token_ids=(1, 2), settings=S.resolve({"mode": "dense", "draft_len": 2, **exact}))
    assert not wire.draft_to_pb(same).draft.HasField("settings")
    assert wire.draft_from_pb(wire.draft_to_pb(other).draft) == other
    assert wire.draft_from_pb(wire.draft_to_pb(same).draft).settings is None


@pytest.mark.parametrize("name", S.setting_names())
def test_every_setting_has_a_cli_flag_and_an_openai_key(name) -> None:
    flag = "--" + name.replace("_", "-")
    option_strings = {s for a in build_parser()._actions for s in a.option_strings}
    serve_strings = {s for a in build_serve_parser()._actions for s in a.option_strings}
    assert flag in option_strings and flag in serve_strings
    default = getattr(S.DraftSettings(), name)
    value = default.value if isinstance(default, Mode) else list(default) if isinstance(default, tuple) else default
    assert openai_schema.parse_overrides({name: value}) == {name: S.check_value(name, value)}


def test_cli_flags_not_given_stay_out_of_the_config() -> None:
    """Unset flags must not override the drafter's recorded operating point."""
    args = build_parser().parse_args(["--edge", "h:1", "--prompt", "p", "--top-k", "32", "--alpha", "0.2",
                                      "--tree", "2,2", "--no-coupled-bonus"])
    assert config_from_args(args).draft == {"top_k": 32, "csqs_alpha": 0.2, "tree": (2, 2),
                                           "coupled_bonus": False}
    bare = config_from_args(build_parser().parse_args(["--edge", "h:1", "--prompt", "p"]))
    assert bare.draft == {}


@pytest.mark.parametrize("name,value", [("top_k", 0), ("top_p", 1.5), ("draft_len", 0), ("lattice", -1),
                                        ("mode", "zip"), ("tree", (2, 0)), ("dense_dtype", "fp8"),
                                        ("csqs_alpha", 1.5), ("bit_budget", -5), ("coupled_bonus", 1)])
def test_the_one_check_refuses_out_of_bounds_values(name, value) -> None:
    with pytest.raises(ValueError, match=name):
        S.check_value(name, value)


def test_zero_means_off_where_the_table_says_so() -> None:
    assert S.check_value("bit_budget", 0) == 0 and S.check_value("top_p", 0) == 0.0
    with pytest.raises(ValueError):
        S.check_value("draft_len", 0)


def test_resolve_order_given_then_operating_point_then_table() -> None:
    s = S.resolve({"top_k": 8}, {"top_k": 256, "draft_len": 6, "name": "not a setting"}, vocab_size=100)
    assert (s.top_k, s.draft_len, s.lattice) == (8, 6, S.DraftSettings().lattice)
    assert S.resolve({}, {"top_k": 256}, vocab_size=100).top_k == 100  # capped at the vocabulary
    assert S.resolve({"mode": "dssd"}).coupled_bonus is True           # DSSD chains draft ahead too
    assert S.resolve({"tree": [2, 2]}).coupled_bonus is False           # does not apply to trees


def test_validate_reads_only_what_the_mode_reads() -> None:
    S.validate(dataclasses.replace(S.DraftSettings(mode=Mode.DSSD, coupled_bonus=False), lattice=0, top_k=0))
    with pytest.raises(ValueError, match="lattice"):
        S.validate(dataclasses.replace(S.DraftSettings(mode=Mode.KSQS), lattice=0))
    S.validate(S.DraftSettings(mode=Mode.DSSD, coupled_bonus=True))
    with pytest.raises(ValueError, match="coupled_bonus"):
        S.validate(S.DraftSettings(mode=Mode.TSLT, tree=(2, 2), coupled_bonus=True))


def test_hello_round_trip_keeps_the_session_settings() -> None:
    h = Hello(vocab_fingerprint="x", vocab_size=50, temperature=1.0, seed=2**63 + 5,
              draft=S.resolve({"mode": "tslt", "top_k": 16, "tree": (2, 2), "csqs_alpha": 0.25, "csqs_eta": 0.5,
                               "csqs_beta0": 0.125}))
    assert wire.hello_from_pb(wire.hello_to_pb(h).hello) == h


def test_device_config_is_hashable_and_its_given_settings_immutable() -> None:
    from specdec.device.factory import DeviceConfig

    cfg = DeviceConfig.of(mode="ksqs", top_k=8, temperature=1.0)
    assert hash(cfg) == hash(DeviceConfig.of(temperature=1.0, top_k=8, mode="ksqs"))
    assert cfg.draft == {"mode": "ksqs", "top_k": 8} and cfg.with_draft(top_k=9).draft["top_k"] == 9
    with pytest.raises(TypeError):
        cfg.draft["top_k"] = 1
