"""Packet codecs for one draft distribution per mode: what goes on the wire, and its decode.

The device encodes its draft distribution ``q``, then samples the draft token from
``decode_distribution(payload)`` -- the very function the edge runs on the received bytes -- so
both sides hold the same ``q_hat`` bit for bit, and speculative verification against it is
lossless whatever the compression (SQS §2: "quantize-and-sample"; TSLT §3: "sparsify-then-sample").

References: TSLT is Zheng et al., "Fast Collaborative Inference via Distributed Speculative
Decoding"; SQS is Bhattacharjee et al., "Conformal Sparsification for Bandwidth-Efficient Edge-Cloud
Speculative Decoding"; DSSD is Ning, Zheng and Yang, "DSSD: Efficient Edge-Device LLM Deployment and
Collaborative Inference via Distributed Split Speculative Decoding" (ICML 2025).

Modes and wire formats (``w = ceil(log2 V)`` bits per token id):
  * dense: V little-endian probabilities in ``dense_dtype``. Theoretical bits V (b_prob + w),
    TSLT eq. (3).
  * tslt: varint K | K ids bit-packed at w bits | K little-endian fp16 log-probabilities
    (``log q - max log q`` on the kept set; log-probs are valid logits, TSLT Solution 1).
    Decoded by a float64 softmax. Theoretical bits K (16 + w), TSLT eq. (3) on the kept set.
  * ksqs: subset index of the top-K support in ceil(log2 C(V, K) / 8) bytes | lattice
    composition index in ceil(log2 C(ell+K-1, K-1) / 8) bytes; K = cfg.top_k is fixed, so
    the support may hold zero-probability tokens (count 0). Theoretical bits = SQS eq. (5) +
    eq. (2), each rounded up to whole bits.
  * csqs: varint K | K ids bit-packed at w bits | composition index bytes. Support
    ``{x : q(x) >= beta}`` (SQS eq. 6) capped at ``max_k``. Theoretical bits w (for K) + K w
    (ids) + eq. (2), SQS section 3 "Communication Overhead".
  * dssd: no distribution is sent; the uplink carries per-position scalars q_i(x_i).
Decoded sqs probabilities are exactly ``b / ell`` (float64); zero-count tokens are dropped.

Bit counts of a whole number of bits use exact integer arithmetic (``int.bit_length``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import lattice
from .modes import Mode
from .distributions import (
    SparseDist,
    dropped_mass_unchecked,
    top_k_ids_unchecked,
    truncate_threshold,
    truncate_top_k,
    truncate_top_p,
)
from .validation import (DENSE_PACKET_SUM_ATOL, VERIFY_SUM_ATOL, check_int, check_lattice, check_prob_scalars,
                         check_probs, check_unit_interval)


# dense_dtype -> (torch dtype, bits per probability b_prob).
_DENSE_DTYPES = {"fp32": (torch.float32, 32), "fp16": (torch.float16, 16), "bf16": (torch.bfloat16, 16)}
# Little-endian wire dtype per dense_dtype (bf16 travels as its raw int16 bit pattern).
_DENSE_WIRE = {"fp32": "<f4", "fp16": "<f2", "bf16": "<i2"}
# TSLT sends fp16 log-probabilities: b_prob = 16 in TSLT eq. (3).
_TSLT_VALUE_BITS = 16
# Token ids travel as unsigned 32-bit at most (every tokenizer in use is far below 2**32).
MAX_VOCAB_SIZE = 2**32
# A varint for K < 2**32 needs at most 5 bytes of 7 payload bits.
_MAX_VARINT_BYTES = 5
# DSSD scalars are float64 probabilities q_i(x_i), see encode_dssd_scalars.
_SCALAR_BYTES = 8
_SCALAR_BITS = 8 * _SCALAR_BYTES


def _ceil_log2(n: int) -> int:
    """ceil(log2 n) for n >= 1, exactly (0 for n = 1)."""
    return (n - 1).bit_length()


@dataclass(frozen=True)
class CodecConfig:
    """Codec settings shared by the device and the edge (negotiated in Hello/Welcome)."""

    mode: Mode  # which codec (a Mode or its string value)
    vocab_size: int  # V, shared tokenizer vocabulary size
    dense_dtype: str = "fp16"  # dense: fp32 | fp16 | bf16 probabilities over V
    top_k: int | None = 64  # tslt (top-K) and ksqs (fixed K); checked against V only there
    top_p: float | None = None  # tslt nucleus; with top_k also set, top-p capped at top_k tokens
    lattice: int = 1000  # ell, lattice resolution for ksqs / csqs
    max_k: int = 4096  # csqs support cap (protocol limit); min(max_k, V) is what applies

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {[m.value for m in Mode]}") from None
        check_int(self.vocab_size, "vocab_size", 1, MAX_VOCAB_SIZE)
        if self.dense_dtype not in _DENSE_DTYPES:
            raise ValueError(f"dense_dtype must be one of {sorted(_DENSE_DTYPES)}, got {self.dense_dtype!r}")
        if self.top_k is not None:
            check_int(self.top_k, "top_k", 1, MAX_VOCAB_SIZE)
        if self.top_p is not None:
            check_unit_interval(self.top_p, "top_p", low_open=True)
        check_lattice(self.lattice, "lattice")
        check_int(self.max_k, "max_k", 1, MAX_VOCAB_SIZE)
        self._check_mode_settings()

    def _check_mode_settings(self) -> None:
        if self.mode in (Mode.TSLT, Mode.KSQS) and self.top_k is not None and self.top_k > self.vocab_size:
            raise ValueError(f"top_k = {self.top_k} exceeds vocab_size = {self.vocab_size}")
        if self.mode == Mode.KSQS and self.top_k is None:
            raise ValueError("ksqs needs top_k (the fixed support size K)")
        if self.mode == Mode.TSLT and self.top_k is None and self.top_p is None:
            raise ValueError("tslt needs top_k or top_p")

    @property
    def id_bits(self) -> int:
        """b_idx = ceil(log2 V) bits per token id (TSLT section 2.2)."""
        return _ceil_log2(self.vocab_size)


@dataclass(frozen=True)
class EncodedDist:
    payload: bytes  # exactly what goes on the wire for this one distribution
    theoretical_bits: int  # the papers' bit count for this distribution
    support_size: int  # K transmitted (V for dense)
    dropped_mass: float  # sum of q outside the transmitted support (0 for dense), for C-SQS


# ----------------------------------------------------------------------------- public API


def encode_distribution(q: torch.Tensor, cfg: CodecConfig, *, threshold: float | None = None) -> EncodedDist:
    """Compress one draft distribution for the uplink.

    Args:
        q: [V] float probabilities summing to 1 (from probs_from_logits).
        cfg: codec settings; V must equal cfg.vocab_size.
        threshold: the C-SQS threshold beta (SQS eq. 6), required for csqs and only there.

    Returns:
        EncodedDist; the device must sample from ``decode_distribution(result.payload, cfg)``.
    """
    if not isinstance(cfg, CodecConfig):
        raise ValueError(f"cfg must be a CodecConfig, got {type(cfg).__name__}")
    check_probs(q, "q")
    q = q.detach().cpu()  # payloads are built on the host; a no-op for CPU tensors
    if q.numel() != cfg.vocab_size:
        raise ValueError(f"q has {q.numel()} entries but vocab_size is {cfg.vocab_size}")
    if (threshold is None) != (cfg.mode != Mode.CSQS):
        raise ValueError("threshold is required for csqs and not accepted by other modes")
    if cfg.mode == Mode.DSSD:
        raise ValueError("dssd sends no distributions; use encode_dssd_scalars")
    encoder = {Mode.DENSE: _encode_dense, Mode.TSLT: _encode_tslt, Mode.KSQS: _encode_ksqs}
    if cfg.mode == Mode.CSQS:
        return _encode_csqs(q, cfg, threshold)
    return encoder[cfg.mode](q, cfg)


def decode_distribution(payload: bytes, cfg: CodecConfig) -> SparseDist:
    """Decode one packet into the distribution q_hat that both the device and the edge use.

    Deterministic and pure: decoding the same bytes twice gives bit-identical tensors.

    Raises:
        ValueError: on any malformed payload (truncated, trailing bytes, ids out of range or
            duplicated, NaN/inf, counts not summing to ell, K out of range, ...).
    """
    if not isinstance(cfg, CodecConfig):
        raise ValueError(f"cfg must be a CodecConfig, got {type(cfg).__name__}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
    if cfg.mode == Mode.DSSD:
        raise ValueError("dssd sends no distributions; use decode_dssd_scalars")
    decoder = {Mode.DENSE: _decode_dense, Mode.TSLT: _decode_tslt, Mode.KSQS: _decode_ksqs,
               Mode.CSQS: _decode_csqs}[cfg.mode]
    try:
        return decoder(bytes(payload), cfg)
    except (IndexError, OverflowError, RuntimeError, TypeError) as exc:
        # Last line of defence: every check above should fire first, but a hostile payload
        # must never surface as anything but ValueError.
        raise ValueError(f"malformed {cfg.mode.value} payload: {exc}") from exc


def encode_dssd_scalars(q_of_draft: torch.Tensor) -> bytes:
    """DSSD uplink scalars q_i(x_i) as little-endian float64.  q_of_draft: [L] float, in (0, 1].

    float64, not float32: the edge's accept test must use exactly the q(x) the device sampled
    from and will use for the residual, bit for bit; 4 more bytes per draft token."""
    if not isinstance(q_of_draft, torch.Tensor) or q_of_draft.ndim != 1 or q_of_draft.numel() == 0:
        raise ValueError("q_of_draft must be a non-empty 1-D tensor")
    if not q_of_draft.is_floating_point():
        raise ValueError(f"q_of_draft must be floating point, got {q_of_draft.dtype}")
    values = q_of_draft.detach().cpu().to(torch.float64)  # [L]
    check_prob_scalars(values, "dssd scalars", wire=True)
    return values.numpy().astype("<f8").tobytes()


def decode_dssd_scalars(payload: bytes, num_draft: int) -> torch.Tensor:
    """Inverse of encode_dssd_scalars.  Returns [L] float64, bit-identical to what was sent."""
    check_int(num_draft, "num_draft", 1, 2**31)
    if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload) != _SCALAR_BYTES * num_draft:
        raise ValueError(f"dssd scalar payload must be {_SCALAR_BYTES * num_draft} bytes")
    values = torch.from_numpy(np.frombuffer(bytes(payload), dtype="<f8").astype(np.float64))  # [L], a copy
    check_prob_scalars(values, "dssd scalars", wire=True)
    return values


def dssd_theoretical_bits(num_draft: int, vocab_size: int) -> int:
    """DSSD uplink bits: L (ceil(log2 V) + 64) -- each draft id plus its float64 q_i(x_i)."""
    check_int(num_draft, "num_draft", 0, 2**31)
    check_int(vocab_size, "vocab_size", 1, MAX_VOCAB_SIZE)
    return num_draft * (_ceil_log2(vocab_size) + _SCALAR_BITS)


# ----------------------------------------------------------------------------- dense


# The DSSD fallback downlink carries p_j as float64: bit for bit what the edge verified against.
FLOAT64_BYTES = 8


def encode_target_probs(p: torch.Tensor) -> bytes:
    """DSSD fallback downlink: p_j [V] float64 as little-endian bytes, bit-exact."""
    if p.dtype != torch.float64 or p.ndim != 1:
        raise ValueError("target probabilities must be a float64 vector [V]")
    return p.contiguous().numpy().astype("<f8").tobytes()


def decode_target_probs(payload: bytes, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`encode_target_probs`: [V] float64 (ValueError on a malformed payload)."""
    if len(payload) != vocab_size * FLOAT64_BYTES:
        raise ValueError(f"target payload of {len(payload)} bytes, expected {vocab_size * FLOAT64_BYTES}")
    p = torch.frombuffer(bytearray(payload), dtype=torch.float64).clone()
    if not torch.isfinite(p).all() or (p < 0).any() or abs(float(p.sum()) - 1.0) > VERIFY_SUM_ATOL:
        raise ValueError("target payload is not a probability vector")
    return p


def _encode_dense(q: torch.Tensor, cfg: CodecConfig) -> EncodedDist:
    dtype, b_prob = _DENSE_DTYPES[cfg.dense_dtype]
    raw = q.detach().to(dtype).contiguous()
    # bf16 has no numpy dtype: ship its raw 16-bit patterns (little-endian like the others).
    array = raw.view(torch.int16) if dtype == torch.bfloat16 else raw
    payload = array.numpy().astype(_DENSE_WIRE[cfg.dense_dtype]).tobytes()
    bits = cfg.vocab_size * (b_prob + cfg.id_bits)  # TSLT eq. (3)
    return EncodedDist(payload=payload, theoretical_bits=bits, support_size=cfg.vocab_size, dropped_mass=0.0)


def _decode_dense(payload: bytes, cfg: CodecConfig) -> SparseDist:
    b_prob = _DENSE_DTYPES[cfg.dense_dtype][1]
    if len(payload) != cfg.vocab_size * b_prob // 8:
        raise ValueError(f"dense payload must be {cfg.vocab_size * b_prob // 8} bytes, got {len(payload)}")
    raw = np.frombuffer(payload, dtype=_DENSE_WIRE[cfg.dense_dtype])
    raw = raw.astype(raw.dtype.newbyteorder("="))  # a writable copy in native order, for torch
    # torch converts 16-bit floats to float64 far faster than numpy's software float16.
    tensor = torch.from_numpy(raw)
    if cfg.dense_dtype == "bf16":
        tensor = tensor.view(torch.bfloat16)
    values = tensor.to(torch.float64).numpy()  # [V]
    total = float(values.sum())  # NaN and inf propagate into the sum
    if not math.isfinite(total) or float(values.min()) < 0:
        raise ValueError("dense payload holds NaN, inf or negative probabilities")
    if abs(total - 1.0) > DENSE_PACKET_SUM_ATOL:
        raise ValueError(f"dense probabilities sum to {total:.6g}, not 1")
    ids = np.flatnonzero(values)
    return SparseDist(ids=torch.from_numpy(ids.astype(np.int64)), probs=torch.from_numpy(values[ids] / total),
                      vocab_size=cfg.vocab_size)


# ----------------------------------------------------------------------------- tslt


def _tslt_support(q: torch.Tensor, cfg: CodecConfig) -> SparseDist:
    if cfg.top_p is None:
        return truncate_top_k(q, cfg.top_k)
    nucleus = truncate_top_p(q, cfg.top_p)
    if cfg.top_k is not None and nucleus.ids.numel() > cfg.top_k:
        return truncate_top_k(q, cfg.top_k)  # the nucleus is a prefix of the same order
    return nucleus


def _encode_tslt(q: torch.Tensor, cfg: CodecConfig) -> EncodedDist:
    kept = _tslt_support(q, cfg)
    log_q = kept.probs.log()  # [K] float64, finite: zero-probability tokens are never kept
    # Centre the largest at 0, where fp16 is finest; softmax is shift-invariant.
    values = (log_q - log_q.max()).to(torch.float16).numpy().astype("<f2")
    K = kept.ids.numel()
    payload = _encode_varint(K) + _pack_ids(kept.ids, cfg.id_bits) + values.tobytes()
    bits = K * (_TSLT_VALUE_BITS + cfg.id_bits)
    return EncodedDist(payload=payload, theoretical_bits=bits, support_size=K,
                       dropped_mass=dropped_mass_unchecked(q, kept.ids))


def _decode_tslt(payload: bytes, cfg: CodecConfig) -> SparseDist:
    K, offset = _decode_varint(payload)
    if not 1 <= K <= cfg.vocab_size:
        raise ValueError(f"tslt support size K = {K} outside [1, {cfg.vocab_size}]")
    id_bytes = (K * cfg.id_bits + 7) // 8
    if len(payload) != offset + id_bytes + 2 * K:
        raise ValueError(f"tslt payload of K = {K} must be {offset + id_bytes + 2 * K} bytes, got {len(payload)}")
    ids = _unpack_ids(payload[offset: offset + id_bytes], K, cfg.id_bits, cfg.vocab_size)
    values = torch.from_numpy(np.frombuffer(payload[offset + id_bytes:], dtype="<f2").astype(np.float64))
    if not bool(torch.isfinite(values).all()):
        raise ValueError("tslt payload holds NaN or inf log-probabilities")
    ids, order = ids.sort()
    if K > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("tslt payload repeats a token id")
    probs = torch.softmax(values[order], dim=0)  # float64 softmax, shift-invariant
    return SparseDist(ids=ids, probs=probs, vocab_size=cfg.vocab_size)


# ----------------------------------------------------------------------------- k-sqs


def _ksqs_sizes(cfg: CodecConfig) -> tuple[int, int]:
    return lattice.subset_bits(cfg.top_k, cfg.vocab_size), lattice.composition_bits(cfg.top_k, cfg.lattice)


def _encode_ksqs(q: torch.Tensor, cfg: CodecConfig) -> EncodedDist:
    ids = top_k_ids_unchecked(q, cfg.top_k).sort().values  # [K], may include q = 0 tokens (count 0)
    counts = lattice.quantize(q[ids].to(torch.float64) / q[ids].double().sum(), cfg.lattice)
    subset_bits, comp_bits = _ksqs_sizes(cfg)
    payload = (lattice.int_to_bytes(lattice.encode_subset(ids, cfg.vocab_size), subset_bits)
               + lattice.int_to_bytes(lattice.encode_composition(counts, cfg.lattice), comp_bits))
    return EncodedDist(payload=payload, theoretical_bits=subset_bits + comp_bits, support_size=cfg.top_k,
                       dropped_mass=dropped_mass_unchecked(q, ids))


def _decode_ksqs(payload: bytes, cfg: CodecConfig) -> SparseDist:
    subset_bits, comp_bits = _ksqs_sizes(cfg)
    split = (subset_bits + 7) // 8
    if len(payload) != split + (comp_bits + 7) // 8:
        raise ValueError(f"ksqs payload must be {split + (comp_bits + 7) // 8} bytes, got {len(payload)}")
    ids = lattice.decode_subset(lattice.int_from_bytes(payload[:split], subset_bits), cfg.top_k, cfg.vocab_size)
    return _lattice_dist(ids, lattice.int_from_bytes(payload[split:], comp_bits), cfg)


def _lattice_dist(ids: torch.Tensor, comp_index: int, cfg: CodecConfig) -> SparseDist:
    """q_hat = b / ell on the support, zero-count tokens dropped."""
    counts = lattice.decode_composition(comp_index, ids.numel(), cfg.lattice)
    nonzero = counts > 0
    return SparseDist(ids=ids[nonzero], probs=counts[nonzero].to(torch.float64) / cfg.lattice,
                      vocab_size=cfg.vocab_size)


# ----------------------------------------------------------------------------- c-sqs


def _csqs_cap(cfg: CodecConfig) -> int:
    return min(cfg.max_k, cfg.vocab_size)


def _encode_csqs(q: torch.Tensor, cfg: CodecConfig, threshold: float) -> EncodedDist:
    kept = truncate_threshold(q, threshold, _csqs_cap(cfg))
    K = kept.ids.numel()
    counts = lattice.quantize(kept.probs, cfg.lattice)
    comp_bits = lattice.composition_bits(K, cfg.lattice)
    payload = (_encode_varint(K) + _pack_ids(kept.ids, cfg.id_bits)
               + lattice.int_to_bytes(lattice.encode_composition(counts, cfg.lattice), comp_bits))
    bits = cfg.id_bits + K * cfg.id_bits + comp_bits  # SQS section 3: K, the ids, eq. (2)
    return EncodedDist(payload=payload, theoretical_bits=bits, support_size=K,
                       dropped_mass=dropped_mass_unchecked(q, kept.ids))


def _decode_csqs(payload: bytes, cfg: CodecConfig) -> SparseDist:
    K, offset = _decode_varint(payload)
    if not 1 <= K <= _csqs_cap(cfg):
        raise ValueError(f"csqs support size K = {K} outside [1, {_csqs_cap(cfg)}]")
    id_bytes = (K * cfg.id_bits + 7) // 8
    comp_bits = lattice.composition_bits(K, cfg.lattice)
    if len(payload) != offset + id_bytes + (comp_bits + 7) // 8:
        raise ValueError(f"csqs payload of K = {K} must be {offset + id_bytes + (comp_bits + 7) // 8} bytes")
    ids = _unpack_ids(payload[offset: offset + id_bytes], K, cfg.id_bits, cfg.vocab_size)
    if K > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("csqs ids must be strictly increasing")
    return _lattice_dist(ids, lattice.int_from_bytes(payload[offset + id_bytes:], comp_bits), cfg)


# ----------------------------------------------------------------------------- wire helpers


def _encode_varint(value: int) -> bytes:
    """Unsigned LEB128."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _decode_varint(data: bytes) -> tuple[int, int]:
    """Canonical unsigned LEB128 at the start of data -> (value, bytes used)."""
    value = 0
    for i, byte in enumerate(data[:_MAX_VARINT_BYTES]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise ValueError("non-canonical varint (trailing zero byte)")
            return value, i + 1
    raise ValueError("truncated or oversized varint")


def _pack_ids(ids: torch.Tensor, width: int) -> bytes:
    """Big-endian bit-pack of ids at ``width`` bits each, zero-padded to a whole byte."""
    if width == 0:
        return b""
    values = ids.numpy().astype(np.uint64)  # [K]
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)  # [width], most significant first
    bits = ((values[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)  # [K, width]
    return np.packbits(bits.ravel()).tobytes()


def _unpack_ids(data: bytes, count: int, width: int, vocab_size: int) -> torch.Tensor:
    """Inverse of _pack_ids; rejects non-zero padding and ids >= vocab_size.  Returns [count] int64."""
    if width == 0:
        return torch.zeros(count, dtype=torch.int64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits[count * width:].any():
        raise ValueError("non-zero padding bits after the packed ids")
    weights = np.left_shift(np.int64(1), np.arange(width - 1, -1, -1, dtype=np.int64))  # [width]
    ids = bits[: count * width].reshape(count, width).astype(np.int64) @ weights  # [count]
    if ids.size and int(ids.max()) >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size})")
    return torch.from_numpy(ids)
