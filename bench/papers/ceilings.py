"""The ceilings, in this process: the target alone, and transformers' assisted generation.

* Target alone (one torch thread, the edge's share): ``model.generate`` with its KV cache, greedy at
  T = 0, plain sampling at T > 0 (``top_k=0, top_p=1``: transformers would otherwise apply its
  default top-k of 50).
* Assisted generation (:data:`ASSISTED_THREADS` torch threads, the two cores the pair's two
  processes use): the same call with ``assistant_model=`` the same default drafter (its LeanDrafter
  behind :class:`~specdec.device.hf_assistant.LeanAssistant`) and a fixed ``num_assistant_tokens = L``
  (constant schedule, no confidence early stop), so the pair, the draft length, the prompts and the
  seeds are those of our loopback points, with no network at all.
Both stop at EOS or ``max_new_tokens``; tokens/s counts the tokens generated over the wall time from
the prompt to the last token (prefill included, as in the device's ``wall_seconds``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.common.modeling import LoadedModel, encode_prompt

WARMUP_TOKENS = 8
ASSISTED_THREADS = 2   # the pair runs device and edge, one thread each: the same two cores in one process


@dataclass
class DecodeStats:
    tokens: int = 0
    seconds: float = 0.0
    sessions: int = 0
    per_session: list = field(default_factory=list)   # (tokens, seconds, cpu seconds) per prompt
    cpu_seconds: float = 0.0                           # this process's CPU time (all threads)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "sessions": self.sessions,
                "tokens_per_second": self.tokens_per_second, "per_session": self.per_session,
                "cpu_seconds": self.cpu_seconds}


def _generation_kwargs(target: LoadedModel, temperature: float, max_new_tokens: int) -> dict:
    from transformers import GenerationConfig

    eos = list(target.eos_token_ids)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    return {"generation_config": GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                                                  pad_token_id=eos[0] if eos else 0, **sampling)}


def as_assistant(drafter: LoadedModel) -> LoadedModel | None:
    """The drafter as transformers' assisted generation takes it (a transformers model, or the
    default drafter's LeanDrafter wrapped in LeanAssistant), or None if it cannot be one."""
    from specdec.device.hf_assistant import as_assistant as wrap

    return wrap(drafter)


def prepare_assistant(drafter: LoadedModel, draft_len: int) -> None:
    """Exactly ``draft_len`` drafted tokens per round, like our chain."""
    gc = drafter.model.generation_config
    gc.num_assistant_tokens = draft_len
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0  # 0 disables the early stop on low draft confidence


def decode(*args, **kw) -> "DecodeStats":
    """``_decode`` with transformers' warnings muted: assisted generation passes its assistant both a
    generation config and loose arguments and says so once per call (harmless, and it breaks the bar)."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _decode(*args, **kw)
    finally:
        hf_logging.set_verbosity(previous)


@torch.inference_mode()
def _decode(target: LoadedModel, prompts: list[str], seeds: list[int], temperature: float, max_new_tokens: int,
            assistant: LoadedModel | None = None, on_done=None) -> DecodeStats:
    kw = _generation_kwargs(target, temperature, max_new_tokens)
    if assistant is None:
        return _timed_generations(target, prompts, seeds, kw, on_done)
    kw["assistant_model"] = assistant.model
    threads = torch.get_num_threads()
    torch.set_num_threads(ASSISTED_THREADS)
    try:
        return _timed_generations(target, prompts, seeds, kw, on_done)
    finally:
        torch.set_num_threads(threads)


def _timed_generations(target: LoadedModel, prompts: list[str], seeds: list[int], kw: dict, on_done) -> DecodeStats:
    stats = DecodeStats()
    for prompt, seed in zip(prompts, seeds):
        ids = torch.tensor([encode_prompt(target.tokenizer, prompt, raw=False)], device=target.device)
        torch.manual_seed(seed)
        c0, t0 = time.process_time(), time.perf_counter()
        out = target.model.generate(ids, **kw)
        seconds, tokens = time.perf_counter() - t0, int(out.shape[1] - ids.shape[1])
        cpu = time.process_time() - c0
        stats.cpu_seconds += cpu
        stats.seconds += seconds
        stats.tokens += tokens
        stats.per_session.append((tokens, seconds, cpu))
        stats.sessions += 1
        if on_done:
            on_done()
    return stats


def warm_up(target: LoadedModel, prompt: str, temperature: float, assistant: LoadedModel | None = None) -> None:
    decode(target, [prompt], [0], temperature, WARMUP_TOKENS)
    if assistant is not None:
        decode(target, [prompt], [0], temperature, WARMUP_TOKENS, assistant)
