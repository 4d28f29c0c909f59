"""The default drafter as a transformers model, for ``generate(assistant_model=...)`` in one process.

:class:`~specdec.device.lean_drafter.LeanDrafter` (int4 layers, reduced head) is a plain torch
module with the call signature :class:`~specdec.common.modeling.CachedLM` uses. transformers'
assisted generation (``AssistedCandidateGenerator``, transformers 5.x) needs more of its assistant:
a ``PreTrainedModel`` with ``GenerationMixin`` (it calls ``assistant.generate`` for each round of
candidates), a ``generation_config``, ``device``, ``config`` (same vocabulary size as the target,
so the same-tokenizer path is taken) and a ``forward`` taking ``past_key_values`` (a DynamicCache,
cropped by transformers after each verification) and ``logits_to_keep``.
:class:`LeanAssistant` is that shell around the same module: the same weights, the same logits.

Kept apart from lean_drafter.py because ``PreTrainedModel`` imports transformers' whole model
stack (~1.5 s, ~90 MB), which device-client does not need.
"""
from __future__ import annotations

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.common.modeling import LoadedModel, cache_field
from specdec.device.lean_drafter import LeanDrafter


class LeanAssistant(PreTrainedModel, GenerationMixin):
    """A :class:`LeanDrafter` behind transformers' model interface (batch 1, no padding)."""

    main_input_name = "input_ids"
    base_model_prefix = "lean"
    _supports_sdpa = True          # LeanDrafter attends through F.scaled_dot_product_attention

    def __init__(self, lean: LeanDrafter):
        super().__init__(lean.config)
        self.lean = lean
        self.generation_config = GenerationConfig.from_model_config(lean.config)
        self.post_init()

    def init_weights(self) -> None:
        """No-op: PreTrainedModel.post_init would re-initialise (randomly) every weight of the
        drafter it wraps; they are the drafter's own, as the delta path built or loaded them."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.lean.embed

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, past_key_values=None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = True, logits_to_keep: int = 0,
                cache=None, **_) -> CausalLMOutputWithPast:
        """input_ids: [1, n]; attention_mask: [1, S] all ones (generate's 2-D padding mask) -> logits
        [1, k, V] (k = logits_to_keep or n), OUT_OF_HEAD_LOGIT outside the drafter's head. Newer transformers
        (5.24 here) pass the KV cache as ``cache``, formerly ``past_key_values``: ignoring it would
        restart every step from an empty cache."""
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
            raise ValueError("LeanAssistant runs one unpadded sequence: the attention mask must be all ones")
        if past_key_values is None:
            past_key_values = cache
        if past_key_values is None:
            from transformers import DynamicCache

            past_key_values = DynamicCache(config=self.config)
        out = self.lean(input_ids, past_key_values, position_ids=position_ids, logits_to_keep=logits_to_keep)
        return CausalLMOutputWithPast(logits=out.logits, **{cache_field(CausalLMOutputWithPast): out.past_key_values})


def as_assistant(drafter: LoadedModel) -> LoadedModel | None:
    """``drafter`` with a model transformers accepts as ``assistant_model``: itself if it is a
    transformers model, a :class:`LeanAssistant` around a LeanDrafter, None otherwise."""
    if isinstance(drafter.model, PreTrainedModel):
        return drafter
    if isinstance(drafter.model, LeanDrafter):
        return LoadedModel(model=LeanAssistant(drafter.model).eval(), tokenizer=drafter.tokenizer,
                           name=drafter.name, device=drafter.device)
    return None
