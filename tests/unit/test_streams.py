"""Named random streams (common/streams.py): replay, separation, full 64-bit seeds, the state layout."""
from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from specdec.common.streams import Purpose, stream, stream_key

DRAWS = 4


def _draws(seed: int, purpose: Purpose, position: int, n: int = DRAWS) -> tuple[float, ...]:
    return tuple(torch.rand(n, generator=stream(seed, purpose, position), dtype=torch.float64).tolist())


def test_the_same_key_replays_the_same_numbers() -> None:
    assert _draws(7, Purpose.VERIFY, 130) == _draws(7, Purpose.VERIFY, 130)
    assert _draws(2**64 - 1, Purpose.DRAFT, 2**64 - 1) == _draws(2**64 - 1, Purpose.DRAFT, 2**64 - 1)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1])
def test_seeds_differing_above_bit_32_give_different_streams(seed) -> None:
    """torch's manual_seed keeps only 32 bits: s and s + 2**32 must still differ, and so must the
    top bit of the 64-bit wire seed."""
    base = _draws(seed, Purpose.VERIFY, 10)
    for other in (seed + 2**32, seed + 2**40, seed + 2**63):
        assert _draws(other, Purpose.VERIFY, 10) != base, other


def test_no_two_streams_of_a_session_collide() -> None:
    """Every (seed, purpose, position) of several sessions' first 1,500 positions: distinct keys and
    distinct first draws (a collision would make two rounds or two purposes share numbers)."""
    seeds = (0, 1, 2**32, 2**63 + 5)
    keys, firsts = set(), set()
    count = 0
    for seed, purpose, position in itertools.product(seeds, Purpose, range(1500)):
        keys.add(stream_key(seed, purpose, position))
        firsts.add(_draws(seed, purpose, position, 2))
        count += 1
    assert len(keys) == count and len(firsts) == count


def test_adjacent_positions_are_not_shifted_copies() -> None:
    """A stream is not the next one advanced by a few draws (as seed + position schemes can be)."""
    a = _draws(3, Purpose.VERIFY, 100, 64)
    b = _draws(3, Purpose.VERIFY, 101, 64)
    assert not set(a) & set(b)


def test_generator_state_is_the_hashed_twister_key() -> None:
    """The layout streams.py writes is the one torch reads: the first doubles equal a reference
    Mersenne Twister (numpy's MT19937) keyed with the same 624 words, combined as torch does
    (two 32-bit outputs, the low 53 bits, times 2**-53)."""
    seed, purpose, position = 2**40 + 9, Purpose.DSSD_RESOLVE, 77
    words = np.frombuffer(hashlib.shake_256(stream_key(seed, purpose, position)).digest(624 * 4), "<u4")
    reference = np.random.MT19937()
    reference.state = {"bit_generator": "MT19937", "state": {"key": words.astype(np.uint32), "pos": 624}}
    raw = reference.random_raw(2 * DRAWS).astype(np.uint64)
    combined = ((raw[0::2] << np.uint64(32)) | raw[1::2]) & np.uint64(2**53 - 1)
    expected = tuple((combined.astype(np.float64) * 2.0**-53).tolist())
    assert _draws(seed, purpose, position) == expected


@pytest.mark.parametrize("args", [(-1, Purpose.DRAFT, 0), (2**64, Purpose.DRAFT, 0), (0, Purpose.DRAFT, -1),
                                  (0, 99, 0), (1.5, Purpose.DRAFT, 0), (True, Purpose.DRAFT, 0)])
def test_bad_keys_are_refused(args) -> None:
    with pytest.raises(ValueError):
        stream(*args)


def test_exponentials_are_the_documented_derivation() -> None:
    """Pinned so that every peer computes the same noise: PCG64DXSM seeded by SeedSequence with the
    key's digest, the top 53 bits of each raw word centred in their interval, then -log."""
    from specdec.common.streams import exponentials
    seed, purpose, position = 2**40 + 9, Purpose.TOKEN_NOISE, 77
    entropy = int.from_bytes(stream_key(seed, purpose, position), "little")
    raw = np.random.PCG64DXSM(np.random.SeedSequence(entropy)).random_raw(6)
    expected = -np.log(((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53)
    got = exponentials(seed, purpose, position, 6)
    assert got.dtype == torch.float64 and got.tolist() == expected.tolist()
    assert exponentials(seed, purpose, position, 3).tolist() == expected[:3].tolist()  # a prefix: V does not reshuffle
    assert bool((exponentials(seed, purpose, position, 100_000) > 0).all())
    assert exponentials(seed, purpose, position + 1, 6).tolist() != expected.tolist()
