"""What the recorder keeps of the default drafter, and how it is stored. Pure: no torch, no I/O
beyond the file helpers at the end.

Two kinds of recording, one per temperature regime:

* :class:`PositionTable` (T = 0): the verified sequence is always the target's greedy path, so the
  drafter's proposal at every start position along that path, with its payloads and drafting time,
  is everything any session on that prompt can ask for, whatever the draft lengths and round
  boundaries the edge's load makes it take.
* :class:`SessionLog` (T > 0): one real device session, round by round: every Draft message it sent
  (serialized), its drafting time, whether it was drafted ahead, and the edge's verdict. The edge
  draws all its randomness from (session seed, purpose, position), so the same messages on an edge
  with the same seed get the same verdicts: the replay is the session itself, as long as they do.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Bumped when what a recording holds or how it is measured changes: old cache files are not reused.
RECORDING_VERSION = 2  # 2: step times are the faster of two walks


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


@dataclass
class Proposal:
    """The drafter's round at one start position: up to L tokens, their codec payloads, and the
    seconds each drafting step took (forward + sampling + encoding)."""
    tokens: list[int]
    payloads: list[bytes]
    step_s: list[float]

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "payloads": [_b64(p) for p in self.payloads], "step_s": self.step_s}

    @classmethod
    def from_json(cls, d: dict) -> "Proposal":
        return cls(list(d["tokens"]), [_unb64(p) for p in d["payloads"]], list(d["step_s"]))


@dataclass
class PositionTable:
    """T = 0: the target's greedy continuation of ``prompt_ids`` and the drafter's proposal at each
    start position ``len(prompt_ids) + i`` along it (key: i, tokens generated so far)."""
    prompt: str
    prompt_ids: list[int]
    path: list[int]                  # the target's greedy tokens after the prompt (EOS kept, if any)
    proposals: dict[int, Proposal]   # generated-so-far -> proposal
    hello: bytes                     # the real device's serialized Hello (DeviceMessage)
    eos_ids: list[int]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    kind: str = "positions"

    def to_json(self) -> dict:
        return {"kind": self.kind, "version": RECORDING_VERSION, "prompt": self.prompt,
                "prompt_ids": self.prompt_ids, "path": self.path, "hello": _b64(self.hello),
                "eos_ids": self.eos_ids, "max_new_tokens": self.max_new_tokens, "meta": self.meta,
                "proposals": {str(k): v.to_json() for k, v in sorted(self.proposals.items())}}

    @classmethod
    def from_json(cls, d: dict) -> "PositionTable":
        return cls(d["prompt"], list(d["prompt_ids"]), list(d["path"]),
                   {int(k): Proposal.from_json(v) for k, v in d["proposals"].items()},
                   _unb64(d["hello"]), list(d["eos_ids"]), int(d["max_new_tokens"]), d.get("meta", {}))


@dataclass
class LoggedRound:
    """One round of a real session: the Draft it sent, how long drafting it took on the device, and
    whether that drafting began while the edge verified the round before (drafting ahead)."""
    draft: bytes                     # serialized DeviceMessage(draft=...)
    draft_s: float                   # drafter forwards + sampling + encoding of this round
    drafted_ahead: bool
    num_accepted: int
    next_token: int
    wait_s: float = 0.0              # send -> verdict in the recording (for the record, not replayed)

    def to_json(self) -> dict:
        d = asdict(self)
        d["draft"] = _b64(self.draft)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LoggedRound":
        return cls(**{**d, "draft": _unb64(d["draft"])})


@dataclass
class SessionLog:
    """T > 0: one real session with a fixed seed, every round as sent and answered."""
    prompt: str
    prompt_ids: list[int]
    seed: int
    temperature: float
    tokens: list[int]                # what the session generated
    rounds: list[LoggedRound]
    hello: bytes
    eos_ids: list[int]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    kind: str = "session"

    def to_json(self) -> dict:
        return {"kind": self.kind, "version": RECORDING_VERSION, "prompt": self.prompt,
                "prompt_ids": self.prompt_ids, "seed": self.seed, "temperature": self.temperature,
                "tokens": self.tokens, "rounds": [r.to_json() for r in self.rounds], "hello": _b64(self.hello),
                "eos_ids": self.eos_ids, "max_new_tokens": self.max_new_tokens, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "SessionLog":
        return cls(d["prompt"], list(d["prompt_ids"]), int(d["seed"]), float(d["temperature"]), list(d["tokens"]),
                   [LoggedRound.from_json(r) for r in d["rounds"]], _unb64(d["hello"]), list(d["eos_ids"]),
                   int(d["max_new_tokens"]), d.get("meta", {}))


def from_json(d: dict) -> PositionTable | SessionLog:
    return PositionTable.from_json(d) if d["kind"] == "positions" else SessionLog.from_json(d)


# ----------------------------------------------------------------------------- the cache
def cache_key(*, prompt: str, temperature: float, seed: int, max_new_tokens: int, drafter: str,
              target: str, settings: dict) -> str:
    """Name of one recording: everything its content depends on (T = 0 ignores the seed)."""
    ident = {"v": RECORDING_VERSION, "prompt": prompt, "temperature": temperature,
             "seed": seed if temperature > 0 else 0, "max_new_tokens": max_new_tokens, "drafter": drafter,
             "target": target, "settings": settings}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return f"{'t0' if temperature == 0 else 'T' + format(temperature, 'g')}-{digest}"


def save(rec: PositionTable | SessionLog, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(rec.to_json(), f)
    tmp.replace(path)  # a half-written file never looks like a recording


def load(path: Path) -> PositionTable | SessionLog | None:
    """The recording at ``path``; None if missing, unreadable or of another version."""
    try:
        with gzip.open(path, "rt") as f:
            d = json.load(f)
    except (OSError, ValueError, EOFError):
        return None
    return from_json(d) if d.get("version") == RECORDING_VERSION else None
