"""Log-probabilities of emitted tokens, as a verdict carries them when the session asks (OpenAI's
``logprobs`` / ``top_logprobs``). Pure functions over tensors.

What is reported: at T > 0 the log-probability under the law the token was drawn from (temperature,
bias, penalties, grammar, top-k, top-p, min-p: :class:`~specdec.common.sampling.TargetLaw`); at T = 0,
where that law is one-hot, the log-softmax of the same shaped logits at temperature 1 without the
filters (what OpenAI reports for a greedy request: the model's own confidence, bias, penalties and
grammar included). Tokens the law excludes have log-probability ``-inf`` and are never among the top.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# OpenAI's bound on top_logprobs (the edge refuses more: each entry costs the downlink ~6 bytes a token).
MAX_TOP_LOGPROBS = 20
NO_LOGPROBS = -1  # a session that asks for none (0: the emitted tokens' own, N: and the top N)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and, when asked, the ``N`` most likely tokens' (descending).

    As a verdict carries it the token itself is left out of ``top`` when it is among them (``in_top``:
    it usually is, and the device knows which token it is), which saves the downlink an entry a token;
    :meth:`complete` puts it back."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    in_top: bool = False  # the token is among the top N and left out of ``top``

    def complete(self, token: int) -> "TokenLogprob":
        """The full top list, the emitted ``token`` back in its place."""
        if not self.in_top:
            return self
        return TokenLogprob(self.logprob, descending(self.top + ((token, self.logprob),)))


def descending(top) -> tuple[tuple[int, float], ...]:
    """(id, log-probability) entries most likely first (ties by id)."""
    return tuple(sorted(top, key=lambda e: (-e[1], e[0])))


def token_logprobs(probs: torch.Tensor,   # [n, V] float64, the law of each emitted token's position
                   tokens: list[int], top_n: int, compact: bool = False) -> tuple[TokenLogprob, ...]:
    """Each emitted token's log-probability under its row, and the top ``top_n`` of the row (``compact``:
    as a verdict carries them, the token itself left out of its top)."""
    assert probs.ndim == 2 and probs.shape[0] == len(tokens), (tuple(probs.shape), len(tokens))
    assert 0 <= top_n <= MAX_TOP_LOGPROBS, top_n
    logs = torch.log(probs.double())                                   # [n, V]; log 0 = -inf
    rows = torch.arange(len(tokens), device=logs.device)
    chosen = logs[rows, torch.tensor(tokens, dtype=torch.long, device=logs.device)].tolist()
    if not top_n:
        return tuple(TokenLogprob(lp) for lp in chosen)
    values, ids = torch.topk(logs, min(top_n, logs.shape[1]), dim=-1)  # [n, N], descending
    out = []
    for token, lp, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist()):
        top = tuple((i, v) for i, v in zip(row_ids, row_values) if v > -math.inf)
        in_top = compact and any(i == token for i, _ in top)
        out.append(TokenLogprob(lp, tuple(e for e in top if e[0] != token) if in_top else top, in_top))
    return tuple(out)
