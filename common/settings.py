"""Draft settings: the one table every layer derives from.

A draft setting is declared once, as a field of :class:`DraftSettings` with its default, bounds,
help text and the modes that read it (:func:`setting`). From that table come the device's CLI flags
(``device/cli.py``), the OpenAI ``specdec`` object's validation (``device/openai_schema.py``),
the wire conversion (``common/wire.py``, by field name: the proto message has the same fields, and
``tests/unit/test_settings.py`` checks that it does) and the edge's checks (:func:`validate`).

Settings are per round: a ``Draft`` says how it was drafted (mode, K, lattice, length, tree, ...)
whenever that differs from the session's, so a controller may change them between rounds without a
new session. What cannot change within a session (temperature, the target's top-k / top-p, the seed,
the vocabulary) lives in ``Hello`` only.

Conventions: "off" is ``0`` for numbers, ``()`` for the tree, ``False`` for flags; ``None`` never
means off. Pure: no I/O, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Mapping

from specdec.common.modes import (ALL_MODES, AUTO, DRAFTING_MODES, LATTICE_MODES, NO_CODEC_MODES, TOP_K_MODES,
                                   Mode)

if TYPE_CHECKING:
    from specdec.common.codecs import CodecConfig


CHAIN_ONLY = "chain"  # a setting read only by chain rounds (not trees)
SETTING_KEY = "draft_setting"  # where :func:`setting` keeps its metadata in a dataclass field
UINT32_MAX = 2**32 - 1  # integer settings travel as proto uint32


@dataclass(frozen=True)
class SettingInfo:
    """What the table says about one draft setting besides its default."""
    help: str
    low: float | None = None          # smallest allowed value (numbers)
    high: float | None = None         # largest allowed value (numbers)
    low_open: bool = False            # ``low`` itself excluded
    zero_is_off: bool = False         # 0 is also allowed and means off
    choices: tuple[str, ...] = ()     # allowed values (strings / enums by value)
    modes: frozenset[Mode] = ALL_MODES  # modes whose rounds read it
    aliases: tuple[str, ...] = ()     # older names still accepted by the CLI and the OpenAI object


def setting(default: Any, help: str, **info: Any) -> Any:
    """A :class:`DraftSettings` field: its default and its :class:`SettingInfo`."""
    return field(default=default, metadata={SETTING_KEY: SettingInfo(help=help, **info)})


@dataclass(frozen=True)
class DraftSettings:
    """How one round is drafted. Each field is one row of the table (name = CLI flag = wire field)."""
    mode: Mode = setting(Mode.TSLT, "draft mode: what the uplink carries per draft position; auto = the "
                                    "device picks mode, K and draft length each round from what it measures",
                         choices=(*(m.value for m in Mode), AUTO))
    draft_len: int = setting(4, "chain length L (upper bound when bit_budget is set)", low=1,
                             modes=DRAFTING_MODES)
    bit_budget: int = setting(0, "per-round uplink budget B in bits; the round drafts the longest chain "
                                 "that fits (SQS section 4); 0 = off", low=1, zero_is_off=True)
    top_k: int = setting(64, "tslt / ksqs support size K", low=1, modes=TOP_K_MODES)
    top_p: float = setting(0.0, "tslt nucleus mass instead of top-K; 0 = off", low=0.0, high=1.0,
                           low_open=True, zero_is_off=True, modes=frozenset({Mode.TSLT}))
    lattice: int = setting(1000, "ksqs / csqs lattice resolution l", low=1, high=UINT32_MAX,
                           modes=LATTICE_MODES)
    dense_dtype: str = setting("fp16", "dense payload dtype", choices=("fp32", "fp16", "bf16"),
                               modes=frozenset({Mode.DENSE}))
    csqs_alpha: float = setting(0.01, "C-SQS target dropped mass alpha (SQS eq. 7)", low=0.0, high=1.0,
                                low_open=True, modes=frozenset({Mode.CSQS}), aliases=("alpha",))
    csqs_eta: float = setting(0.001, "C-SQS learning rate eta (SQS eq. 8)", low=0.0, low_open=True,
                              modes=frozenset({Mode.CSQS}), aliases=("eta",))
    csqs_beta0: float = setting(0.001, "C-SQS initial threshold beta_1^1", low=0.0, high=1.0,
                                modes=frozenset({Mode.CSQS}), aliases=("beta0",))
    max_k: int = setting(4096, "C-SQS support cap", low=1, modes=frozenset({Mode.CSQS}))
    dssd_samples: int = setting(8, "DSSD: target samples sent downlink after a rejection", low=1,
                                modes=frozenset({Mode.DSSD}))
    dssd_fallback_top_k: int = setting(
        64, "DSSD: when every target sample fails, the edge sends p_j's K largest entries, the mass of the "
            "rest and samples of it (about 11 bytes per entry) instead of the whole p_j (8 bytes per "
            "vocabulary entry); 0 = the whole p_j", low=1, zero_is_off=True, modes=frozenset({Mode.DSSD}))
    tree: tuple[int, ...] = setting((), "token tree expansion configuration <k1..kL>, e.g. 2,2,2; "
                                        "() = a chain of draft_len",
                                    modes=DRAFTING_MODES - {Mode.DSSD, Mode.GUMBEL})
    coupled_bonus: bool = setting(True, "chain rounds: the edge draws the bonus token with noise both "
                                        "sides derive from the seed and its position, so the device can "
                                        "guess it and draft ahead at T > 0 (lossless either way; gumbel "
                                        "rounds always do)",
                                  modes=DRAFTING_MODES - {Mode.GUMBEL})
    edge_tokens: int = setting(0, "mode none: tokens the edge generates and streams per round; 0 = all "
                                  "that remain", low=1, high=UINT32_MAX, zero_is_off=True,
                               modes=frozenset({Mode.NONE}))

    def codec(self, vocab_size: int) -> CodecConfig | None:
        """The codec both sides build for this round's payloads (None in DSSD, gumbel and none: they
        send none)."""
        from specdec.common.codecs import CodecConfig  # the codecs depend on this table, not it on them
        if self.mode in NO_CODEC_MODES:
            return None
        # Settings this mode does not read may arrive as 0 from a device: the codec gets the defaults.
        used = {name: getattr(self, name) if self.mode in _INFO[name].modes else getattr(_DEFAULTS, name)
                for name in ("dense_dtype", "lattice", "max_k")}
        # TSLT with top-p keeps top-K as the cap on its support (CodecConfig), as K-SQS needs K.
        top_k = min(self.top_k, vocab_size) if self.top_k else None
        return CodecConfig(mode=self.mode, vocab_size=vocab_size, top_k=top_k, top_p=self.top_p or None,
                           **used)

    @property
    def is_tree(self) -> bool:
        return bool(self.tree)

    @property
    def coupled(self) -> bool:
        """Whether this round's bonus token is a Gumbel-max draw with noise both sides derive from the
        seed and its position (the coupled bonus; in gumbel rounds always, with the position's token
        noise), so that the device can guess it."""
        if self.mode is Mode.GUMBEL:
            return True
        return self.coupled_bonus and not self.tree and self.mode is not Mode.NONE


def setting_info(name: str) -> SettingInfo:
    return _INFO[name]


def setting_names() -> tuple[str, ...]:
    """Every draft setting, in table order."""
    return tuple(_INFO)


_INFO: dict[str, SettingInfo] = {f.name: f.metadata[SETTING_KEY] for f in fields(DraftSettings)}
_DEFAULTS = DraftSettings()
_ALIASES: dict[str, str] = {alias: name for name, info in _INFO.items() for alias in info.aliases}


def canonical_name(name: str) -> str:
    """The table name of ``name`` (an alias such as ``alpha`` -> ``csqs_alpha``); KeyError if unknown."""
    if name in _INFO:
        return name
    return _ALIASES[name]


def check_value(name: str, value: Any) -> Any:
    """``value`` converted to the setting's type and checked against its bounds (ValueError if not).

    The one check behind the CLI flags, the OpenAI object and the wire."""
    default = getattr(_DEFAULTS, name)
    info = _INFO[name]
    if isinstance(default, Mode):
        return _enum(name, value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        return _branching(name, value)
    if isinstance(default, str):
        if value not in info.choices:
            raise ValueError(f"{name} must be one of {list(info.choices)}, got {value!r}")
        return value
    return _number(name, value, type(default), info)


def _enum(name: str, value: Any) -> Mode | str:
    if value == AUTO:
        return AUTO
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {list(_INFO[name].choices)}, got {value!r}") from None


def wants_auto(given: Mapping[str, Any]) -> bool:
    """Whether the user asked for ``mode auto`` (the device's controller picks every round's settings)."""
    return given.get("mode") == AUTO


def _branching(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in value):
        raise ValueError(f"{name} must be a list of branching factors >= 1, e.g. [2, 2, 2], got {value!r}")
    return tuple(value)


def _number(name: str, value: Any, kind: type, info: SettingInfo):
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (kind is float and not math.isfinite(value)):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a finite number'}, got {value!r}")
    if info.zero_is_off and value == 0:
        return kind(value)
    low, high = info.low, info.high
    if (low is not None and (value < low or (info.low_open and value == low))) or \
            (high is not None and value > high):
        rng = f"{'(' if info.low_open else '['}{low if low is not None else '-inf'}, " \
              f"{high if high is not None else 'inf'}]"
        off = " or 0 (off)" if info.zero_is_off else ""
        raise ValueError(f"{name} must be in {rng}{off}, got {value!r}")
    return kind(value)


class GivenSettings(dict):
    """Draft settings a user gave, by table name: an immutable, hashable mapping (configs are keys)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _immutable(self, *args, **kwargs):
        raise TypeError("GivenSettings is immutable; build a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _immutable  # type: ignore


def parse_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name or alias: raw value}`` -> ``{table name: checked value}`` (ValueError on the first bad one)."""
    out: dict[str, Any] = {}
    for key, value in given.items():
        try:
            name = canonical_name(key)
        except KeyError:
            raise ValueError(f"unknown draft setting {key!r} (known: {', '.join(_INFO)})") from None
        out[name] = check_value(name, value)
    return out


def resolve(given: Mapping[str, Any], operating_point: Mapping[str, Any] = (), vocab_size: int = 0) -> DraftSettings:
    """The session's settings: what the user gave, else the drafter's recorded operating point (the
    default drafter records its best L and K), else the table's defaults. K is capped at the
    vocabulary, the coupled bonus is off where it does not apply (trees)."""
    recorded = {k: v for k, v in dict(operating_point).items() if k in _INFO}
    chosen = parse_settings({**recorded, **given})
    if chosen.get("mode") == AUTO:  # the controller starts from the defaults and re-plans every round
        del chosen["mode"]
    s = replace(_DEFAULTS, **chosen)
    if vocab_size:
        s = replace(s, top_k=min(s.top_k, vocab_size))
    return replace(s, coupled_bonus=s.coupled)


# With no draft advised (the edge is loaded), a device asks for this many edge-only tokens per round,
# then looks at the edge's advice again: load changes as sessions come and go, over seconds.
EDGE_ONLY_CHUNK = 8


def within_draft_len(s: DraftSettings, limit: int | None, edge_tokens: int = EDGE_ONLY_CHUNK) -> DraftSettings:
    """``s`` drafting at most ``limit`` tokens per round (a tree at most ``limit`` deep); ``limit``
    0 makes it an edge-only round of ``edge_tokens`` tokens, None leaves it as it is. The edge's
    load-aware advice, applied to whatever the device chose (issue 19: the smaller of the two)."""
    if limit is None or s.mode is Mode.NONE:
        return s
    if limit == 0:
        return replace(s, mode=Mode.NONE, edge_tokens=edge_tokens, tree=(), bit_budget=0, coupled_bonus=False)
    if s.tree:
        return replace(s, tree=s.tree[:limit])
    return replace(s, draft_len=min(s.draft_len, limit))


def within_limits(s: DraftSettings, max_draft_len: int = 0, max_k: int = 0, dssd_max_samples: int = 0) -> DraftSettings:
    """``s`` cut to an edge's limits (0: a limit the edge does not state), as its Welcome gives them:
    a round retried on another edge after a broken stream is drafted within what that edge takes
    (edge/verifier.py checks the same limits)."""
    if s.mode is Mode.NONE:
        return s
    if max_draft_len:
        s = within_draft_len(s, max_draft_len)
    if max_k and s.mode in TOP_K_MODES:
        s = replace(s, top_k=min(s.top_k, max_k))
    if max_k and s.mode is Mode.CSQS:
        s = replace(s, max_k=min(s.max_k, max_k))
    if dssd_max_samples and s.mode is Mode.DSSD:
        s = replace(s, dssd_samples=min(s.dssd_samples, dssd_max_samples))
    return s


def validate(s: DraftSettings) -> None:
    """Every field the round's mode reads within the table's bounds, and the combinations that make
    sense (ValueError). Fields another mode reads are not looked at: a device may leave them zero."""
    if not isinstance(s.mode, Mode):
        raise ValueError(f"mode must be one of {[m.value for m in Mode]} in a round, got {s.mode!r}")
    for name, info in _INFO.items():
        if s.mode in info.modes:
            check_value(name, getattr(s, name))
    if s.coupled_bonus and not s.coupled:
        raise ValueError("coupled_bonus applies to chain rounds only")
    if s.tree and s.mode in NO_CODEC_MODES:
        raise ValueError(f"token trees need draft distributions; {s.mode.value} sends none")
