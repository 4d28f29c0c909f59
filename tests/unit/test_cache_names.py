"""The KV cache reaches every forward under the name the installed transformers takes (``cache`` from
5.24 on, where ``past_key_values`` warns; ``past_key_values`` before, as on the GPU machine's 5.17):
no deprecation warning, and the cache is really used."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from specdec.common.modeling import CachedLM, cache_field, cache_kwargs, load_model, ModelSpec, returned_cache
from specdec.testbed import tiny_models


def test_cached_forwards_do_not_warn_and_use_the_cache(tmp_path, caplog) -> None:
    target = load_model(ModelSpec(model=str(tiny_models.make_model(tmp_path / "m", 64, seed=1))))
    ids = [5, 9, 13, 2, 40, 7]
    lm = CachedLM(target.model, torch.device("cpu"))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # a FutureWarning (or any other) fails the test
        lm.forward(ids[:4], 1)
        step = lm.forward(ids[4:], 2)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
    assert lm.cache_len == len(ids)
    whole = CachedLM(target.model, torch.device("cpu")).forward(ids, 2)
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)  # the prefix came from the cache


class _Old(torch.nn.Module):  # transformers before 5.24, and the int4 default drafter's forward
    def forward(self, input_ids, past_key_values=None, **kw):
        return _OldOut(logits=input_ids, past_key_values=past_key_values)


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, **kw):
        return _NewOut(logits=input_ids, cache=cache)


@dataclass
class _OldOut:
    logits: object
    past_key_values: object


@dataclass
class _NewOut:
    logits: object
    cache: object


def test_each_model_gets_the_name_it_declares() -> None:
    for model, out_type, name in ((_Old(), _OldOut, "past_key_values"), (_New(), _NewOut, "cache")):
        kw = cache_kwargs(model, "kv")
        assert kw == {name: "kv"}
        assert cache_field(out_type) == name
        assert returned_cache(model(torch.zeros(1), **kw)) == "kv"
