"""Tests for specdec.common.codecs: per-mode packet round trips, bit counts, robustness."""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.common.codecs import (
    CodecConfig,
    EncodedDist,
    decode_distribution,
    decode_dssd_scalars,
    dssd_theoretical_bits,
    encode_distribution,
    encode_dssd_scalars,
)
from specdec.common.modes import Mode
from specdec.common.distributions import (
    check_sparse_dist,
    densify,
    dropped_mass,
    probs_from_logits,
    truncate_threshold,
    truncate_top_k,
    tv_distance,
)
from specdec.common.lattice import composition_bits, subset_bits

HYPOTHESIS = settings(max_examples=40, deadline=None)
SEQUENCE_MODES = [Mode.DENSE, Mode.TSLT, Mode.KSQS, Mode.CSQS]
# fp16 keeps 11 significant bits: relative rounding error <= 2^-11 on normal numbers, absolute
# <= 2^-25 on subnormals (below 2^-14); bf16 keeps 8 bits and has float32's range.
FP16_REL, FP16_ABS = 2.0**-11, 2.0**-25
BF16_REL = 2.0**-8


def random_q(V, seed, scale=4.0, temperature=1.0):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale
    return probs_from_logits(logits, temperature)


def encode(q, cfg, threshold=0.01):
    return encode_distribution(q, cfg, threshold=threshold if cfg.mode == Mode.CSQS else None)


def id_bits(V):
    return math.ceil(math.log2(V)) if V > 1 else 0


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs", [
    dict(mode="nope", vocab_size=10),
    dict(mode=Mode.TSLT, vocab_size=0),
    dict(mode=Mode.TSLT, vocab_size=10, top_k=0),
    dict(mode=Mode.TSLT, vocab_size=10, top_k=11),
    dict(mode=Mode.KSQS, vocab_size=10, top_k=11),
    dict(mode=Mode.KSQS, vocab_size=10, top_k=None),
    dict(mode=Mode.TSLT, vocab_size=10, top_k=None, top_p=None),
    dict(mode=Mode.TSLT, vocab_size=10, top_p=0.0),
    dict(mode=Mode.TSLT, vocab_size=10, top_p=1.5),
    dict(mode=Mode.KSQS, vocab_size=10, top_k=4, lattice=0),
    dict(mode=Mode.KSQS, vocab_size=10, top_k=4, lattice=10.0),
    dict(mode=Mode.DENSE, vocab_size=10, dense_dtype="fp8"),
    dict(mode=Mode.CSQS, vocab_size=10, max_k=0),
    dict(mode=Mode.DENSE, vocab_size=10, top_k=-1),
])
def test_config_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        CodecConfig(**kwargs)


def test_config_accepts_strings_and_small_vocabularies():
    cfg = CodecConfig("csqs", 32)  # default top_k = 64 and max_k = 4096 do not apply to csqs here
    assert cfg.mode is Mode.CSQS and cfg.id_bits == 5
    assert CodecConfig(Mode.DENSE, 32).mode is Mode.DENSE


def test_mode_mismatches_are_rejected():
    q = random_q(50, 0)
    with pytest.raises(ValueError):
        encode_distribution(q, CodecConfig(Mode.CSQS, 50))  # threshold missing
    with pytest.raises(ValueError):
        encode_distribution(q, CodecConfig(Mode.KSQS, 50, top_k=4), threshold=0.1)
    with pytest.raises(ValueError):
        encode_distribution(q, CodecConfig(Mode.DSSD, 50))
    with pytest.raises(ValueError):
        decode_distribution(b"", CodecConfig(Mode.DSSD, 50))
    with pytest.raises(ValueError):
        encode_distribution(random_q(51, 0), CodecConfig(Mode.DENSE, 50))  # wrong V
    with pytest.raises(ValueError):
        encode_distribution(q * 2, CodecConfig(Mode.DENSE, 50))  # not a distribution


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dtype, rel, abs_, b_prob", [
    ("fp32", 0.0, 0.0, 32), ("fp16", FP16_REL, FP16_ABS, 16), ("bf16", BF16_REL, 0.0, 16),
])
def test_dense_round_trip_within_dtype_rounding(dtype, rel, abs_, b_prob):
    V = 5000
    q = random_q(V, 1)
    cfg = CodecConfig(Mode.DENSE, V, dense_dtype=dtype)
    enc = encode_distribution(q, cfg)
    assert len(enc.payload) == V * b_prob // 8
    assert enc.theoretical_bits == V * (b_prob + 13)  # TSLT eq. (3), ceil(log2 5000) = 13
    assert enc.support_size == V and enc.dropped_mass == 0.0
    sd = decode_distribution(enc.payload, cfg)
    check_sparse_dist(sd)
    # Each value moves by <= rel q + abs; renormalising adds at most |1 - sum| to the TV.
    q64 = q.double()
    budget = rel + V * abs_ + abs(1.0 - float(q64.sum()))
    assert tv_distance(q64 / q64.sum(), densify(sd)) <= budget + 1e-12


def test_dense_drops_exact_zeros():
    q = torch.tensor([0.0, 0.75, 0.0, 0.25])
    sd = decode_distribution(encode_distribution(q, CodecConfig(Mode.DENSE, 4)).payload, CodecConfig(Mode.DENSE, 4))
    assert sd.ids.tolist() == [1, 3] and sd.probs.tolist() == [0.75, 0.25]


# ----------------------------------------------------------------------------- tslt


def tslt_bound(values_max_abs):
    """TV between softmax(v) and softmax(v + d) with |d_i| <= delta is <= (e^{2 delta} - 1) / 2."""
    delta = FP16_REL * values_max_abs + FP16_ABS
    return (math.exp(2 * delta) - 1) / 2


@HYPOTHESIS
@given(V=st.integers(2, 3000), seed=st.integers(0, 10**6), k=st.integers(1, 300),
       scale=st.floats(0.1, 12.0))
def test_tslt_top_k_round_trip(V, seed, k, scale):
    k = min(k, V)
    q = random_q(V, seed, scale)
    cfg = CodecConfig(Mode.TSLT, V, top_k=k)
    enc = encode_distribution(q, cfg)
    kept = truncate_top_k(q, k)
    K = kept.ids.numel()
    assert enc.support_size == K and enc.theoretical_bits == K * (16 + id_bits(V))
    assert enc.dropped_mass == dropped_mass(q, kept.ids)
    sd = decode_distribution(enc.payload, cfg)
    check_sparse_dist(sd)
    assert torch.equal(sd.ids, kept.ids)
    log_range = float(kept.probs.log().max() - kept.probs.log().min())
    assert tv_distance(densify(kept), densify(sd)) <= tslt_bound(log_range) + 1e-12
    assert tv_distance(q.double() / q.double().sum(), sd) <= enc.dropped_mass + tslt_bound(log_range) + 1e-9


def test_tslt_top_p_capped_by_top_k():
    V = 2000
    q = random_q(V, 2, scale=1.0)  # diffuse: the 0.9 nucleus is large
    nucleus = decode_distribution(encode_distribution(q, CodecConfig(Mode.TSLT, V, top_k=None, top_p=0.9)).payload,
                                  CodecConfig(Mode.TSLT, V, top_k=None, top_p=0.9))
    assert nucleus.ids.numel() > 50
    cfg = CodecConfig(Mode.TSLT, V, top_k=50, top_p=0.9)
    capped = decode_distribution(encode_distribution(q, cfg).payload, cfg)
    assert torch.equal(capped.ids, truncate_top_k(q, 50).ids)
    tight = CodecConfig(Mode.TSLT, V, top_k=500, top_p=0.3)
    assert decode_distribution(encode_distribution(q, tight).payload, tight).ids.numel() < 500


# ----------------------------------------------------------------------------- k-sqs / c-sqs


@HYPOTHESIS
@given(V=st.integers(1, 5000), seed=st.integers(0, 10**6), k=st.integers(1, 200),
       ell=st.integers(1, 3000), scale=st.floats(0.1, 12.0))
def test_ksqs_round_trip(V, seed, k, ell, scale):
    k = min(k, V)
    q = random_q(V, seed, scale)
    cfg = CodecConfig(Mode.KSQS, V, top_k=k, lattice=ell)
    enc = encode_distribution(q, cfg)
    sbits, cbits = subset_bits(k, V), composition_bits(k, ell)
    assert enc.theoretical_bits == sbits + cbits  # SQS eq. (1), (2), (5)
    assert len(enc.payload) == (sbits + 7) // 8 + (cbits + 7) // 8
    assert enc.support_size == k
    sd = decode_distribution(enc.payload, cfg)
    check_sparse_dist(sd)
    counts = (sd.probs * ell).round()
    assert torch.equal(sd.probs, counts / ell) and int(counts.sum()) == ell  # exactly b / ell
    assert set(sd.ids.tolist()) <= set(truncate_top_k(q, k).ids.tolist())
    q64 = q.double() / q.double().sum()
    # Lemma 1 + eq. (20) + triangle inequality.
    assert tv_distance(q64, sd) <= enc.dropped_mass + k / (4 * ell) + 1e-9


@HYPOTHESIS
@given(V=st.integers(1, 5000), seed=st.integers(0, 10**6), beta=st.floats(-0.1, 1.2),
       ell=st.integers(1, 3000), max_k=st.integers(1, 400), scale=st.floats(0.1, 12.0))
def test_csqs_round_trip(V, seed, beta, ell, max_k, scale):
    q = random_q(V, seed, scale)
    cfg = CodecConfig(Mode.CSQS, V, lattice=ell, max_k=max_k)
    enc = encode_distribution(q, cfg, threshold=beta)
    kept = truncate_threshold(q, beta, min(max_k, V))
    K = kept.ids.numel()
    assert enc.support_size == K <= max_k
    assert enc.theoretical_bits == id_bits(V) + K * id_bits(V) + composition_bits(K, ell)
    assert enc.dropped_mass == dropped_mass(q, kept.ids)
    sd = decode_distribution(enc.payload, cfg)
    check_sparse_dist(sd)
    assert set(sd.ids.tolist()) <= set(kept.ids.tolist())
    q64 = q.double() / q.double().sum()
    assert tv_distance(q64, sd) <= enc.dropped_mass + K / (4 * ell) + 1e-9


def test_ksqs_support_with_fewer_nonzero_tokens_than_k():
    q = torch.zeros(100)
    q[[3, 40]] = torch.tensor([0.25, 0.75])
    cfg = CodecConfig(Mode.KSQS, 100, top_k=8, lattice=4)
    sd = decode_distribution(encode_distribution(q, cfg).payload, cfg)
    assert sd.ids.tolist() == [3, 40] and sd.probs.tolist() == [0.25, 0.75]


# ----------------------------------------------------------------------------- all modes


def configs(V):
    return [
        (CodecConfig(Mode.DENSE, V), None),
        (CodecConfig(Mode.DENSE, V, dense_dtype="bf16"), None),
        (CodecConfig(Mode.TSLT, V, top_k=min(16, V)), None),
        (CodecConfig(Mode.TSLT, V, top_k=None, top_p=0.8), None),
        (CodecConfig(Mode.KSQS, V, top_k=min(16, V), lattice=100), None),
        (CodecConfig(Mode.CSQS, V, lattice=100, max_k=64), 0.002),
    ]


@pytest.mark.parametrize("cfg, threshold", configs(3000))
def test_device_and_edge_decode_bit_identically(cfg, threshold):
    q = random_q(3000, 5)
    enc = encode_distribution(q, cfg, threshold=threshold)
    assert isinstance(enc, EncodedDist) and isinstance(enc.payload, bytes)
    a, b = decode_distribution(enc.payload, cfg), decode_distribution(bytes(bytearray(enc.payload)), cfg)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs) and a.vocab_size == b.vocab_size
    # Re-encoding the same q gives the same bytes (no hidden randomness).
    assert encode_distribution(q, cfg, threshold=threshold).payload == enc.payload


@pytest.mark.parametrize("cfg, threshold", configs(3000))
def test_greedy_one_hot_survives_every_codec(cfg, threshold):
    q = random_q(3000, 6, temperature=0.0)
    sd = decode_distribution(encode_distribution(q, cfg, threshold=threshold).payload, cfg)
    assert sd.ids.tolist() == [int(q.argmax())] and sd.probs.tolist() == [1.0]


def test_vocabulary_of_one_token():
    q = torch.ones(1)
    for cfg, threshold in configs(1):
        sd = decode_distribution(encode_distribution(q, cfg, threshold=threshold).payload, cfg)
        assert sd.ids.tolist() == [0] and sd.probs.tolist() == [1.0]


# ----------------------------------------------------------------------------- malformed payloads


def test_specific_malformed_payloads():
    V = 300
    tslt = CodecConfig(Mode.TSLT, V, top_k=4)
    good = encode_distribution(random_q(V, 1), tslt).payload
    bad = [
        b"", good[:-1], good + b"\x00",
        b"\x00" + good[1:],  # K = 0
        b"\x80\x00" + good[1:],  # non-canonical varint
        b"\xff\xff\xff\xff\xff\x01",  # oversized varint
    ]
    for payload in bad:
        with pytest.raises(ValueError):
            decode_distribution(payload, tslt)
    # Two identical ids: K = 2, both ids 7 (9 bits each), zero values.
    dup = b"\x02" + ((7 << 9 | 7) << 6).to_bytes(3, "big") + b"\x00" * 4
    with pytest.raises(ValueError):
        decode_distribution(dup, tslt)
    nan = bytearray(good)
    nan[-2:] = b"\x00\x7e"  # fp16 NaN
    with pytest.raises(ValueError):
        decode_distribution(bytes(nan), tslt)
    ksqs = CodecConfig(Mode.KSQS, V, top_k=4, lattice=10)
    with pytest.raises(ValueError):  # subset index >= C(V, K)
        decode_distribution(b"\xff" * len(encode_distribution(random_q(V, 1), ksqs).payload), ksqs)
    dense = CodecConfig(Mode.DENSE, 4)
    with pytest.raises(ValueError):
        decode_distribution(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float16).numpy().tobytes(), dense)
    with pytest.raises(ValueError):
        decode_distribution("not bytes", dense)


@pytest.mark.parametrize("mode_index", range(6))
def test_mutated_payloads_decode_or_raise_value_error(mode_index):
    V = 1000
    cfg, threshold = configs(V)[mode_index]
    if cfg.mode == Mode.DENSE:
        cfg = CodecConfig(Mode.DENSE, 64, dense_dtype=cfg.dense_dtype)  # keep the byte space small
    rng = random.Random(mode_index)
    payloads = [encode_distribution(random_q(cfg.vocab_size, s, scale=rng.uniform(0.5, 8)), cfg,
                                    threshold=threshold).payload for s in range(4)]
    for trial in range(250):
        data = bytearray(rng.choice(payloads))
        action = rng.randrange(5)
        if action == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif action == 1 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif action == 2:
            data = data[: rng.randrange(len(data) + 1)]
        elif action == 3:
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        else:
            data = bytearray(rng.randrange(256) for _ in range(rng.randrange(len(data) + 2)))
        try:
            sd = decode_distribution(bytes(data), cfg)
        except ValueError:
            continue
        check_sparse_dist(sd)
        assert sd.vocab_size == cfg.vocab_size


# ----------------------------------------------------------------------------- dssd


def test_dssd_scalars_round_trip():
    values = torch.tensor([0.5, 1.0, 1e-30, 0.123456789012345678], dtype=torch.float64)
    payload = encode_dssd_scalars(values)
    assert len(payload) == 32
    out = decode_dssd_scalars(payload, 4)
    assert out.dtype == torch.float64 and torch.equal(out, values)  # bit for bit
    assert dssd_theoretical_bits(4, 152_064) == 4 * (18 + 64)
    assert dssd_theoretical_bits(0, 10) == 0


@pytest.mark.parametrize("call", [
    lambda: encode_dssd_scalars(torch.tensor([0.5, 0.0])),
    lambda: encode_dssd_scalars(torch.tensor([1.5])),
    lambda: encode_dssd_scalars(torch.tensor([float("nan")])),
    lambda: encode_dssd_scalars(torch.tensor([])),
    lambda: encode_dssd_scalars(torch.tensor([[0.5]])),
    lambda: decode_dssd_scalars(b"\x00\x00\x00", 1),
    lambda: decode_dssd_scalars(encode_dssd_scalars(torch.tensor([0.5])), 2),
    lambda: decode_dssd_scalars(torch.tensor([float("nan")], dtype=torch.float64).numpy().tobytes(), 1),
    lambda: decode_dssd_scalars(torch.tensor([-0.5], dtype=torch.float64).numpy().tobytes(), 1),
    lambda: decode_dssd_scalars(torch.tensor([0.0], dtype=torch.float64).numpy().tobytes(), 1),
    lambda: decode_dssd_scalars(b"", 0),
    lambda: dssd_theoretical_bits(-1, 10),
    lambda: dssd_theoretical_bits(1, 0),
])
def test_dssd_scalars_reject_bad_input(call):
    with pytest.raises(ValueError):
        call()
