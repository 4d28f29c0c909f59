"""Input checks of the math core: tensors, probability rows, token ids, logits, generators, scalars.

Every public math function validates its input on entry with these checks, and bad input raises
``ValueError`` (the servicer maps it to INVALID_ARGUMENT). Each tolerance below has one purpose,
named for it; a check never picks a tolerance from a caller's module.

Conventions: the tensor checkers take ``(x, name, constraints...)`` and return nothing; the scalar
checkers take ``(value, name, constraints...)`` and return the value as a plain ``int`` or
``float``. ``bool`` is never accepted as a number.
"""
from __future__ import annotations

import math

import numpy as np
import torch

# ----------------------------------------------------------------------------- tolerances

# A probability vector handed to truncation, the codecs or the lattice (check_probs) comes from a
# float32 softmax, whose sum is off by ~1e-6 even over 150k tokens; 1e-3 still rejects
# unnormalised or wrong inputs (logits passed as probabilities, a mask instead of a distribution).
SOFTMAX_SUM_ATOL = 1e-3
# The same for float16 / bfloat16 vectors: ~3 decimal digits each, so their sum over a large
# vocabulary drifts further than a float32 softmax's.
HALF_PRECISION_SUM_ATOL = 1e-2
# Rows handed to verification are float64 and were normalised in float64 (decoded packets,
# engine probabilities), so anything further from 1 than this is a caller bug, not rounding. It is
# also the slack above 1 allowed for one token's probability there (check_prob_scalars).
VERIFY_SUM_ATOL = 1e-6
# A dense packet decoded from the wire: fp16 rounding (and flushing tails below its subnormal
# range) moves the sum by well under 1%, so a sum further from 1 than this is garbage.
DENSE_PACKET_SUM_ATOL = 0.05

# Lattice resolutions above this would lose exactness in the float64 product ell * q.
MAX_LATTICE = 2**40

_HALF_PRECISION = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- scalars


def check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (no upper bound if ``high`` is None)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value!r}")
    return value


def check_uint(value: object, name: str, bits: int) -> int:
    """``value`` as an int in ``[0, 2**bits)``: a fixed-width unsigned field (seeds, positions,
    packed indices). numpy integers are accepted, as they arrive from arrays."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= int(value) < 2**bits:
        raise ValueError(f"{name} must be in [0, 2**{bits}), got {value}")
    return int(value)


def check_real(value: object, name: str, low: float = -math.inf, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float in the interval from ``low`` to ``high`` (closed unless said)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name} must be a finite real{_interval(low, high, low_open, high_open)}, got {value!r}")
    return float(value)


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """' in (0, 1]', ' >= 0', or '' (any finite real), for error messages."""
    if math.isinf(low) and math.isinf(high):
        return ""
    if math.isinf(high):
        return f" {'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_nonnegative(value: object, name: str) -> float:
    """``value`` as a finite float >= 0 (a time, a temperature)."""
    return check_real(value, name, 0.0)


def check_positive(value: object, name: str) -> float:
    """``value`` as a finite float > 0 (a rate or time divided by, a learning rate)."""
    return check_real(value, name, 0.0, low_open=True)


def check_unit_interval(value: object, name: str, *, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float in [0, 1], or (0, 1), (0, 1], [0, 1) with the open ends given."""
    return check_real(value, name, 0.0, 1.0, low_open=low_open, high_open=high_open)


def check_lattice(ell: object, name: str = "lattice resolution ell") -> int:
    """A lattice resolution ``ell`` in [1, MAX_LATTICE] (SQS appendix A.1)."""
    return check_int(ell, name, 1, MAX_LATTICE)


# ----------------------------------------------------------------------------- tensors


def check_tensor(x: object, name: str) -> torch.Tensor:
    """``x`` itself, if it is a torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_generator(generator: object) -> None:
    """Raise unless ``generator`` is a torch.Generator: randomness is always injected."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _check_prob_values(x: torch.Tensor, name: str, atol: float) -> None:
    """Dtype, finiteness, sign and per-row sum (last dim) of a probability tensor [..., V].

    Two passes over the data: a float64 sum (NaN and inf propagate into it, and into its rows' largest
    error; a sum overflowing to inf is rejected too, rightly) and a minimum. Few tensor operations:
    on a small vocabulary (the tests' toy laws, a tree's rows) each one's dispatch is the cost.
    """
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    sums = x.sum(dim=-1, dtype=torch.float64)  # [...]
    error = (sums - 1.0).abs().flatten()  # [rows]
    worst = float(error.max())
    if not math.isfinite(worst):
        raise ValueError(f"{name} contains NaN or inf")
    if float(x.min()) < 0:
        raise ValueError(f"{name} contains negative probabilities")
    if worst > atol:
        row = int(error.argmax())
        where = f" row {row}" if x.ndim > 1 else ""
        raise ValueError(f"{name}{where} sums to {float(sums.flatten()[row])!r}, not 1 (tolerance {atol})")


def check_probs(q: torch.Tensor, name: str) -> None:
    """Raise unless ``q`` is a non-empty 1-D float probability vector [V] (a softmax output).

    Sum tolerance: HALF_PRECISION_SUM_ATOL for float16 / bfloat16, else SOFTMAX_SUM_ATOL.
    """
    check_tensor(q, name)
    if q.ndim != 1 or q.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(q.shape)}")
    _check_prob_values(q, name, HALF_PRECISION_SUM_ATOL if q.dtype in _HALF_PRECISION else SOFTMAX_SUM_ATOL)


def check_sparse_probs(probs: torch.Tensor, ids: torch.Tensor, name: str) -> None:
    """Raise unless ``probs`` [K] float64 is a probability vector on the support ``ids`` [K]."""
    check_tensor(probs, name)
    if probs.dtype != torch.float64 or probs.shape != ids.shape:
        raise ValueError(f"{name} must be float64 with the same shape as ids")
    _check_prob_values(probs, name, SOFTMAX_SUM_ATOL)


def check_prob_rows(x: torch.Tensor, name: str, rows: int | None = None, vocab: int | None = None) -> None:
    """Raise unless ``x`` is a float64 matrix [rows, vocab] of probability rows for verification.

    Sum tolerance: VERIFY_SUM_ATOL.
    """
    check_tensor(x, name)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, vocab], got shape {tuple(x.shape)}")
    if x.dtype != torch.float64:
        raise ValueError(f"{name} must be float64 (verification works in float64), got {x.dtype}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(x.shape)}")
    if vocab is not None and x.shape[1] != vocab:
        raise ValueError(f"{name} must have vocab size {vocab}, got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has an empty vocabulary")
    _check_prob_values(x, name, VERIFY_SUM_ATOL)


def check_prob_vector(x: torch.Tensor, name: str, vocab: int | None = None) -> None:
    """Raise unless ``x`` is a float64 probability vector [vocab] for verification."""
    if not isinstance(x, torch.Tensor) or x.ndim != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D tensor [vocab], got {shape}")
    check_prob_rows(x.unsqueeze(0), name, 1, vocab)


def check_prob_scalars(x: torch.Tensor, name: str, length: int | None = None, *, wire: bool = False) -> None:
    """Raise unless ``x`` is a float64 vector [length] of single-token probabilities.

    For verification each must lie in [0, 1 + VERIFY_SUM_ATOL]: the slack of the rows it was read
    from. ``wire=True`` (DSSD uplink scalars q_i(x_i), sent bit for bit): each must lie in (0, 1],
    exactly, as a sampled token's probability in a float64-normalised row does.
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 1 or (length is not None and x.numel() != length):
        count = "" if length is None else f" {length}"
        raise ValueError(f"{name} must be a 1-D tensor of{count} probabilities")
    if x.dtype != torch.float64:
        raise ValueError(f"{name} must be float64, got {x.dtype}")
    if wire:
        if not bool(torch.isfinite(x).all()) or not bool(((x > 0) & (x <= 1)).all()):
            raise ValueError(f"{name} must be finite probabilities in (0, 1]")
    elif not bool(torch.isfinite(x).all()) or bool((x < 0).any()) or bool((x > 1 + VERIFY_SUM_ATOL).any()):
        raise ValueError(f"{name} must hold probabilities in [0, 1], got {x.tolist()}")


def check_token_ids(ids: torch.Tensor, name: str, vocab: int | None = None, length: int | None = None) -> None:
    """Raise unless ``ids`` is a non-empty 1-D int64 vector [length] of ids in ``[0, vocab)``.

    ``vocab=None`` checks only the layout (for callers that learn V from the ids' companion).
    """
    check_tensor(ids, name)
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError(f"{name} must be non-empty")
    if length is not None and ids.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {ids.numel()}")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} has ids out of range [0, {vocab}): {ids.tolist()}")


def check_sorted_ids(ids: torch.Tensor, name: str, vocab: int) -> None:
    """Raise unless ``ids`` [K] int64 is a support: non-empty, strictly increasing, in ``[0, vocab)``."""
    check_token_ids(ids, name)
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
        raise ValueError(f"{name} out of range [0, {vocab})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{name} must be strictly increasing (sorted, no duplicates)")


def check_drafts_sampleable(ids: torch.Tensor, q_of_ids: torch.Tensor, name: str, first_index: int = 0) -> None:
    """Raise if a drafted token has q(x) == 0: it could not have been sampled from q, so the packet
    and the draft disagree (and verifying would divide by zero).

    ids: [n] int64 drafted tokens; q_of_ids: [n] their draft probabilities; ``first_index``: the
    index of ids[0] in the caller's own numbering, for the message.
    """
    if float(q_of_ids.min()) <= 0:
        i = int((q_of_ids <= 0).nonzero()[0, 0])
        raise ValueError(f"{name}[{i + first_index}] = {int(ids[i])} has draft probability 0: "
                         "it cannot have been sampled from q")


def check_counts(b: torch.Tensor, ell: int) -> None:
    """Raise unless ``b`` [K] int64 are lattice counts: non-empty, non-negative, summing to ell."""
    if not isinstance(b, torch.Tensor) or b.dtype != torch.int64 or b.ndim != 1 or b.numel() == 0:
        raise ValueError("counts b must be a non-empty 1-D int64 tensor")
    if bool((b < 0).any()):
        raise ValueError("counts b must be non-negative")
    if int(b.sum()) != ell:
        raise ValueError(f"counts b must sum to ell = {ell}, got {int(b.sum())}")


def check_logits(logits: torch.Tensor, temperature: float) -> float:
    """Raise unless ``logits`` is a finite float tensor [..., V] and ``temperature`` >= 0;
    returns the temperature as a float."""
    check_tensor(logits, "logits")
    if not logits.is_floating_point() or logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be a float tensor [..., V] with V >= 1, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    temperature = check_nonnegative(temperature, "temperature")
    # the extremes are finite iff every value is (NaN propagates into them): one pass and two values,
    # where isfinite().all() writes and reduces a bool tensor of every value
    if logits.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(logits))).all()):
        raise ValueError("logits contain NaN or inf")
    return temperature
