"""Token ids packed at ceil(log2 V) bits (common/idpack.py): the paired transform and its checks."""
from __future__ import annotations

import random

import pytest

from specdec.common.idpack import MAX_ID_BITS, MIN_ID_BITS, id_bits, pack_ids, unpack_ids


@pytest.mark.parametrize("vocab, width", [(2, 8), (256, 8), (257, 9), (49152, 16), (65536, 16), (65537, 17),
                                          (151_936, 18), (2**32, 32)])
def test_width_is_ceil_log2_of_the_vocabulary_at_least_a_byte(vocab, width) -> None:
    assert id_bits(vocab) == width


@pytest.mark.parametrize("width", range(MIN_ID_BITS, MAX_ID_BITS + 1))
def test_round_trip_is_exact_at_every_width_and_length(width) -> None:
    rng = random.Random(width)
    for n in range(0, 34):
        ids = tuple(rng.randrange(1 << width) for _ in range(n))
        packed = pack_ids(ids, width)
        assert len(packed) == (n * width + 7) // 8
        assert unpack_ids(packed, width) == ids


def test_two_bytes_per_id_at_the_default_vocabulary() -> None:
    assert len(pack_ids([49151, 0, 12345, 40000], id_bits(49152))) == 8


@pytest.mark.parametrize("ids, width", [([256], 8), ([-1], 8), ([1.0], 8), ([True], 8), ([0], 7), ([0], 33)])
def test_pack_refuses_what_does_not_fit(ids, width) -> None:
    with pytest.raises(ValueError):
        pack_ids(ids, width)


def test_unpack_refuses_set_padding_and_bad_input() -> None:
    good = pack_ids([5, 6, 7], 12)  # 36 bits in 5 bytes: 4 bits of padding
    with pytest.raises(ValueError):
        unpack_ids(good[:-1] + bytes([good[-1] | 0x80]), 12)
    with pytest.raises(ValueError):
        unpack_ids("abc", 12)
    with pytest.raises(ValueError):
        unpack_ids(good, 40)
    assert unpack_ids(b"", 16) == ()
