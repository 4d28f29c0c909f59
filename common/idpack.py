"""Token ids packed at a fixed width: a gumbel round's whole draft payload (no distribution travels).

A protobuf ``repeated uint32`` spends a varint per id: 2 bytes below 16,384 and 3 above, plus a tag
and a length for the list. Ids packed at ``ceil(log2 V)`` bits take 2 bytes each at V = 49152 and
the list one length. Bit order: id i occupies bits ``[i * width, (i + 1) * width)`` of the
little-endian integer the bytes spell, the last byte padded with zero bits. The width is at least a
byte, so the padding (under 8 bits) never holds another id and the count follows from the length.

Pure: no torch, no I/O. Bad input raises ``ValueError``.
"""
from __future__ import annotations

from collections.abc import Sequence

MIN_ID_BITS = 8    # padding < 8 bits < a width: the byte length says how many ids there are
MAX_ID_BITS = 32   # token ids are proto uint32 everywhere else

__all__ = ["MAX_ID_BITS", "MIN_ID_BITS", "id_bits", "pack_ids", "unpack_ids"]


def id_bits(vocab_size: int) -> int:
    """The width ids of a vocabulary of ``vocab_size`` tokens are packed at: ceil(log2 V), at least a byte."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= 2**MAX_ID_BITS:
        raise ValueError(f"vocab_size must be an integer in [1, 2**{MAX_ID_BITS}], got {vocab_size!r}")
    return max(MIN_ID_BITS, (vocab_size - 1).bit_length())


def _check_width(width: int) -> None:
    if not isinstance(width, int) or isinstance(width, bool) or not MIN_ID_BITS <= width <= MAX_ID_BITS:
        raise ValueError(f"id width must be an integer in [{MIN_ID_BITS}, {MAX_ID_BITS}], got {width!r}")


def pack_ids(ids: Sequence[int], width: int) -> bytes:
    """``ids`` at ``width`` bits each: ceil(len(ids) * width / 8) bytes."""
    _check_width(width)
    value = 0
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << width:
            raise ValueError(f"token id {t!r} does not fit in {width} bits")
        value |= t << (i * width)
    return value.to_bytes((len(ids) * width + 7) // 8, "little")


def unpack_ids(data: bytes, width: int) -> tuple[int, ...]:
    """Inverse of :func:`pack_ids`. ValueError if the padding holds set bits (not a packing)."""
    _check_width(width)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"packed ids must be bytes, got {type(data).__name__}")
    n = len(data) * 8 // width
    value = int.from_bytes(bytes(data), "little")
    if value >> (n * width) or (n * width + 7) // 8 != len(data):
        raise ValueError(f"{len(data)} bytes are not ids packed at {width} bits")
    mask = (1 << width) - 1
    return tuple((value >> (i * width)) & mask for i in range(n))
