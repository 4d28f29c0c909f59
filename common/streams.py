"""Named random streams: every random number of a session is drawn from (session seed, purpose, position).

Why: a round retried for any reason (a resume with the edge's KV, a re-prefill on an edge that
restarted or let the session expire, a DSSD fallback whose extra round trip broke) must draw exactly
the numbers its first attempt drew, or the retry re-rolls an outcome that already happened and
biases the output law against the outcomes that make rounds fail. And two different rounds must
never share numbers, or one round's outcome leaks into the next (a fresh edge that seeded one
generator per session reused the uniform that decided round 1 for round 2). Keying every stream by
what it is for and where it is used gives both: a stream is a pure function of its key.

The streams of a session (the one table of who draws what; ``position`` is a sequence index,
prompt included, so the first generated token has position ``len(prompt)``):

============  ======  ===================  ================================================
purpose       side    position             draws, in order
============  ======  ===================  ================================================
DRAFT         device  round start          draft tokens: one uniform per chain position
                                           (inverse CDF of the sent q); trees: k_l uniforms
                                           per internal node, layer by layer
VERIFY        edge    round start          accept uniforms, then the correction or bonus
                                           draw; trees: recursive rejection per node; DSSD:
                                           accepts then the m downlink samples of p_j
DSSD_RESOLVE  device  round start          one uniform per downlink sample y ~ p_j tried
DSSD_RESIDUAL device  round start          the one draw from norm(max(0, p_j - q_j)) after a
                                           whole-p_j fallback
DSSD_HEAD     device  round start          a head fallback's rejection sampling: per trial
                                           head-or-tail, then the head token or the tail
                                           sample's accept test
DSSD_TAIL     edge    round start          a head fallback's samples of p_j's tail
BONUS_NOISE   both    the bonus's position Gumbel noise [V] of the coupled bonus token of a
                                           chain round in dense / tslt / ksqs / csqs / dssd
TOKEN_NOISE   both    the token's position exponential noise E [V] (:func:`exponentials`):
                                           the token the target emits there in a gumbel or
                                           none round is argmin_v E(v) / p(v) (a Gumbel-max
                                           draw); the device drafts argmin_v E(v) / q(v)
EDGE_TOKEN    --      (retired)            mode none's token by inverse CDF, before TOKEN_NOISE
============  ======  ===================  ================================================

TOKEN_NOISE is keyed by the position alone, never by the round: a position's noise is the same
whichever round, mode (gumbel or none), drafter or draft length reaches it, so the tokens of gumbel
and none rounds are a function of (target, prompt, seed, temperature, filters) only. It is drawn by a
faster generator than the others (NumPy's PCG64DXSM keyed by the same digest, raw 64-bit words turned
into uniforms here: 1.3 ms for V = 49152 against 5 ms through torch's twister), since every emitted
token of those rounds needs a whole vocabulary of it on both sides. The coupled bonus of the other
chain rounds keeps BONUS_NOISE, which peers from before TOKEN_NOISE compute too.

A round's start is the position of its first draft token (the verified length when it is drafted;
after a DSSD rejection the correction token is verified first). Rounds of a session start at
strictly increasing positions, so no two rounds share a stream; a retried round starts where its
first attempt started, so it shares exactly that attempt's streams.

Full 64-bit seeds: torch's CPU generator keeps only the low 32 bits of ``manual_seed``, so seeds
``s`` and ``s + 2**32`` would give identical sessions. The key is hashed (SHAKE-256) into the whole
19,968-bit Mersenne Twister state instead, so every bit of seed, purpose and position matters and
two distinct keys collide with probability about 2**-256.
"""
from __future__ import annotations

import enum
import hashlib
import struct

import numpy as np
import torch

from specdec.common.validation import check_uint

__all__ = ["Purpose", "SEED_BITS", "exponentials", "stream", "stream_key"]

SEED_BITS = 64                  # the wire's seed is a uint64; every bit of it reaches the streams
POSITION_BITS = 64
KEY_FORMAT = "<QQQ"             # seed, purpose, position: fixed width, so no two keys share bytes
KEY_DOMAIN = b"specdec.rng.v1:"  # versioned: changing how streams are derived changes this prefix
DIGEST_BYTES = 32

# torch's CPU generator state (ATen CPUGeneratorImplState, torch 2.x): int64 initial seed, int32
# `left`, int32 `seeded`, uint64 `next`, then the 624 Mersenne Twister words as uint64.
MT_WORDS = 624
MT_STATE_BYTES = 5056
MT_LEFT_OFFSET, MT_NEXT_OFFSET, MT_WORDS_OFFSET = 8, 16, 24


class Purpose(enum.IntEnum):
    """What a stream is for; the values are part of the key, never reuse or renumber one."""
    DRAFT = 1
    VERIFY = 2
    DSSD_RESOLVE = 3
    DSSD_RESIDUAL = 4
    BONUS_NOISE = 5
    EDGE_TOKEN = 6  # retired: mode none's tokens before TOKEN_NOISE (kept so that 6 is never reused)
    DSSD_HEAD = 7
    DSSD_TAIL = 8
    TOKEN_NOISE = 9


def stream_key(seed: int, purpose: Purpose, position: int) -> bytes:
    """The 32-byte digest naming one stream (distinct keys give independent streams)."""
    seed, position = check_uint(seed, "seed", SEED_BITS), check_uint(position, "position", POSITION_BITS)
    purpose = Purpose(purpose)
    packed = struct.pack(KEY_FORMAT, seed, int(purpose), position)
    return hashlib.blake2b(KEY_DOMAIN + packed, digest_size=DIGEST_BYTES).digest()


def stream(seed: int, purpose: Purpose, position: int) -> torch.Generator:
    """A fresh CPU generator for one stream: the same key always draws the same numbers.

    The twister's 624 words are filled from the key's digest (stretched with SHAKE-256), and the
    generator is set to twist them before its first output, exactly as after a seeding.
    """
    words = np.frombuffer(hashlib.shake_256(stream_key(seed, purpose, position)).digest(MT_WORDS * 4),
                          dtype="<u4")
    generator = torch.Generator()
    generator.manual_seed(int(words[0]))  # a valid state of the right layout to overwrite
    state = generator.get_state().numpy().copy()
    if state.size != MT_STATE_BYTES:
        raise RuntimeError(f"unexpected torch generator state of {state.size} bytes; "
                           f"streams.py knows the {MT_STATE_BYTES}-byte layout")
    state[MT_LEFT_OFFSET:MT_LEFT_OFFSET + 4] = np.frombuffer(struct.pack("<i", 1), np.uint8)  # twist next
    state[MT_NEXT_OFFSET:MT_NEXT_OFFSET + 8] = 0
    state[MT_WORDS_OFFSET:MT_WORDS_OFFSET + MT_WORDS * 8] = words.astype("<u8").view(np.uint8)
    generator.set_state(torch.from_numpy(state))
    return generator


# Uniforms from raw 64-bit words: the top 53 bits, centred in their interval, so that every uniform
# lies strictly inside (0, 1) and -log u is finite and positive.
UNIFORM_SHIFT = np.uint64(64 - 53)
UNIFORM_SCALE = 2.0 ** -53


def exponentials(seed: int, purpose: Purpose, position: int, n: int) -> torch.Tensor:  # [n] float64
    """``n`` i.i.d. standard exponentials ``-log u`` of one stream, from a counter of NumPy's PCG64DXSM
    seeded with the stream's digest (NumPy keeps the raw output of its bit generators and of
    SeedSequence stable across versions, NEP 19; the uniforms are made here, not by a NumPy method
    whose algorithm may change). Independent of :func:`stream` of any key, including its own."""
    digest = stream_key(seed, purpose, position)
    words = np.random.PCG64DXSM(np.random.SeedSequence(int.from_bytes(digest, "little"))).random_raw(n)
    u = ((words >> UNIFORM_SHIFT).astype(np.float64) + 0.5) * UNIFORM_SCALE
    return torch.from_numpy(-np.log(u))
