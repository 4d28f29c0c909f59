"""The exact-law tests' common part: the target's exact law of its first tokens, and seeded sessions
counted against it, in process or over real gRPC.

A tiny 8-token vocabulary lets the tests enumerate the target's exact distribution over the first
``N_TOKENS`` generated tokens (EOS ends a sequence early); each mode must match it (chi-square on
merged cells, p > P_VALUE_CUT), each negative control must not.

Where the sessions run: every mode's law runs in this process (inprocess.py: the device's round loop
against a real edge session, the product's code on both sides, no gRPC); one law per transport path
(chain, tree, DSSD, edge-only, batched, resume) runs over real gRPC. Sizes: ``LAW_SESSIONS`` in the
default tier, ``HIGH_POWER_SESSIONS`` in the slow one (``make test-slow``); every negative control of
the default tier is rejected at the default size, far below the cut. Half the sessions run in the
``twin`` process (harness.Twin) when one is given: both cores, the same seeds, the same tokens.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch

from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.grammar import Grammar
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.sampling import model_probs
from specdec.common.modes import Mode
from specdec.device.session import DraftSession
from tests.support import reference_law
from tests.support.harness import SessionStats, device_config, load, load_spec, patched, split_sessions
from tests.support.inprocess import run_seeds
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

PROMPT = "w1 w2"
N_TOKENS = 3
TEMPERATURE = 1.0
# default tier: any law at TV >= 0.18 from the exact one is rejected with probability 0.9 (0.155 at 600
# sessions, for 1.5x the time); every control of the default tier is rejected here too
LAW_SESSIONS = 400
HIGH_POWER_SESSIONS = 1500    # slow tier: TV >= 0.10
CONTROL_SESSIONS = 400        # a control whose bias is large needs no more
# A gross control, one whose chi-square at CONTROL_SESSIONS is in the hundreds or thousands (the
# device drafting from another law than the packet it sends, TV ~0.4-0.8; a residual not renormalised;
# tree siblings drawn without replacement), is rejected with a quarter of the sessions, far below the
# cut (the chi-square's noncentrality grows linearly with the sessions): it shows the law test's
# power at LAW_SESSIONS without running as many.
GROSS_CONTROL_SESSIONS = 150
CONCURRENCY = 4               # sessions in flight over gRPC: one's network waits overlap another's compute

MODES = {
    "dense": dict(mode=Mode.DENSE, dense_dtype="bf16"),
    "tslt": dict(mode=Mode.TSLT, top_k=3),
    # chain modes draw the bonus token with the coupled noise by default; this one from the edge's stream
    "tslt uncoupled bonus": dict(mode=Mode.TSLT, top_k=3, coupled_bonus=False),
    "ksqs": dict(mode=Mode.KSQS, top_k=3, lattice=8),
    "csqs": dict(mode=Mode.CSQS, csqs_beta0=0.05, csqs_alpha=0.05, csqs_eta=0.05, lattice=8, max_k=8),
    # a fallback sends p_j's top-1 and (patched, DSSD_PATCHES) one tail sample: the head resolves some,
    # the rest run out and fetch the whole p_j, so both fallback replies are exercised
    "dssd": dict(mode=Mode.DSSD, dssd_samples=1, dssd_fallback_top_k=1),
    "none": dict(mode=Mode.NONE),  # the edge alone, streaming: the baseline every link benchmark uses
    "gumbel": dict(mode=Mode.GUMBEL),  # ids only; every token the target's own race (Daliri et al.)
}


# The transport paths whose law runs over real gRPC in the default tier: a chain, DSSD's uplink scalars
# and fallback trips, edge-only streaming, gumbel's packed ids (test_lossless_e2e.py). In process they
# run in the slow tier only (test_lossless_in_process.py): the same settings, seeds and sessions
# through the same device and edge code would repeat those sessions without the transport.
TRANSPORT_PATHS = ("tslt", "dssd", "none", "gumbel")


# Every mode, and a tree, at settings that compress on the tiny pairs of a few hundred tokens (the
# greedy-identity tests': test_end_to_end.py's settings).
COMPRESSING_MODES = {
    "dense": dict(mode=Mode.DENSE, dense_dtype="fp16"), "tslt": dict(mode=Mode.TSLT, top_k=16),
    "ksqs": dict(mode=Mode.KSQS, top_k=16, lattice=64), "csqs": dict(mode=Mode.CSQS, csqs_beta0=0.01, lattice=64, max_k=64),
    "dssd": dict(mode=Mode.DSSD, dssd_samples=2), "none": dict(mode=Mode.NONE), "gumbel": dict(mode=Mode.GUMBEL),
    "tree": dict(mode=Mode.TSLT, top_k=16, tree=(2, 2)),
    "auto": dict(mode="auto"),  # mode auto's controller choosing every round (DSSD, trees and gumbel among them)
}


# Token trees: every node's two children, two layers deep, in each codec a tree can use.
TREE_LAW = dict(temperature=TEMPERATURE, max_new_tokens=N_TOKENS, tree=(2, 2))
TREE_MODES = {"dense": dict(mode=Mode.DENSE, dense_dtype="fp32"), "tslt": dict(mode=Mode.TSLT, top_k=3),
              "ksqs": dict(mode=Mode.KSQS, top_k=3, lattice=8)}


@lru_cache(maxsize=4)
def exact_law(target_dir: str, prompt_ids: tuple[int, ...], temperature: float = TEMPERATURE, top_k: int = 0,
              top_p: float = 0.0, adjust: LogitAdjust = NO_ADJUST, min_p: float = 0.0,
              grammar: Grammar | None = None) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS generated tokens = s) for the target alone, by enumeration (with the target's
    own temperature, top-k and top-p, as transformers samples it; with bias, penalties or min-p, as
    ``generate`` applies them through transformers' own processors: reference_law.py)."""
    m = load(target_dir)
    eos = set(m.eos_token_ids)
    law: dict[tuple[int, ...], float] = {}
    shaped = adjust.active or min_p > 0 or grammar is not None
    assert not (shaped and (top_k or top_p)), "the reference law here takes bias, penalties and min-p alone"

    def visit(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == N_TOKENS or (seq and seq[-1] in eos):
            law[seq] = law.get(seq, 0.0) + prob
            return
        if shaped:
            p = reference_law.next_probs(m, prompt_ids, seq, adjust, temperature, min_p, grammar)
        else:
            with torch.inference_mode():
                logits = m.model(torch.tensor([list(prompt_ids) + list(seq)])).logits[0, -1].float()
            p = model_probs(logits, temperature, top_k, top_p)
        for tok, pt in enumerate(p.tolist()):
            if pt > 0:
                visit(seq + (tok,), prob * pt)

    visit((), 1.0)
    return law


def prompt_ids(drafter) -> tuple[int, ...]:
    """PROMPT's ids (``drafter``: a checkpoint directory or a ModelSpec)."""
    return tuple(encode_prompt(load_spec(drafter).tokenizer, PROMPT, raw=True))


def sessions_in_process(seeds, target_dir, drafter, cfg_kw: dict, session_factory=DraftSession, **run_kw):
    """One seeded session per seed, the device's round loop against an edge session in this process:
    [(tokens, SessionStats)] (picklable: the unit of work of ``Twin.split``); ``run_kw``: inprocess.generate's
    (``edge_cls``, ``fault``, ``resync``)."""
    drafter_model = load_spec(drafter)
    cfg = device_config(**cfg_kw)
    hello = cfg.hello(vocab_fingerprint(drafter_model.tokenizer), drafter_model.vocab_size, seed=0)
    results = run_seeds(load(str(target_dir)), drafter_model, hello, list(prompt_ids(drafter)), cfg.max_new_tokens,
                        list(seeds), session_factory, **run_kw)
    return [(tokens, SessionStats(session.stats)) for tokens, session in results]


def law_counts(twin, target_dir, drafter, *, num_sessions: int = LAW_SESSIONS, over_grpc: bool = False,
               session_factory=DraftSession, patches=(), temperature: float = TEMPERATURE, max_new_tokens=N_TOKENS,
               draft_len: int | None = 2, run_kw: dict | None = None, **kw) -> tuple[Counter, dict, list]:
    """(counts of the first N_TOKENS of ``num_sessions`` seeded sessions, the exact law, [(tokens,
    stats)]), in process or ``over_grpc``, half in ``twin`` if given; ``patches`` (module, attribute,
    value) apply in both processes while the sessions run; ``run_kw``: inprocess.generate's keywords
    (in process only). ``drafter``: a directory or a ModelSpec."""
    cfg_kw = dict(temperature=temperature, max_new_tokens=max_new_tokens, **kw)
    if draft_len is not None:  # None: the harness's default (device_config)
        cfg_kw["draft_len"] = draft_len
    cfg = device_config(**cfg_kw)
    law = exact_law(str(target_dir), prompt_ids(drafter), temperature, cfg.target_top_k, cfg.target_top_p,
                    cfg.adjust, cfg.target_min_p, cfg.grammar)
    run_kw = run_kw or {}
    assert not (run_kw and over_grpc), "run_kw drives the in-process link"
    seeds = range(num_sessions)
    if over_grpc:
        runs = split_sessions(twin, seeds, target_dir, drafter, cfg_kw, PROMPT, session_factory,
                              concurrency=CONCURRENCY, patches=patches)
        results = [(tokens, stats) for tokens, _, stats in runs]
    elif twin is None:
        with patched(patches):
            results = sessions_in_process(seeds, target_dir, drafter, cfg_kw, session_factory, **run_kw)
    else:
        here, there = twin.split(sessions_in_process, seeds, patches=patches, target_dir=target_dir, drafter=drafter,
                                 cfg_kw=cfg_kw, session_factory=session_factory, **run_kw)
        results = here + there
    return Counter(tuple(tokens[:N_TOKENS]) for tokens, _ in results), law, results


def assert_lossless(counts: Counter, law: dict, what: str) -> None:
    assert set(counts) <= set(law), f"{what}: generated a sequence the target cannot produce"
    fit = goodness_of_fit(counts, law)
    print(f"{what}: {fit}")
    assert fit.p_value > P_VALUE_CUT, f"{what}: {fit}"


def assert_rejected(counts: Counter, law: dict, what: str) -> None:
    """A negative control: sequences outside the law, or a fit far below the cut."""
    outside = sum(c for seq, c in counts.items() if seq not in law)
    inside = Counter({s: c for s, c in counts.items() if s in law})
    if not inside:  # nothing to fit: every sequence is one the target cannot produce
        print(f"control, {what}: all {outside} sequences outside the law")
        assert outside > 0, f"negative control passed: {what}: no sequence at all"
        return
    fit = goodness_of_fit(inside, law)
    print(f"control, {what}: {outside} sequences outside the law, {fit}")
    assert outside > 0 or fit.p_value < P_VALUE_CUT, f"negative control passed: {what}: {fit}"
