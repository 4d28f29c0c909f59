"""The incremental detokenizer both the one-shot command and the daemon stream through: the text it
hands out piece by piece is the whole decode, never a broken character, at linear cost."""
from __future__ import annotations

import pytest

from specdec.device.detokenize import REPLACEMENT_CHAR, Detokenizer

TEXT = "Grüße, 世界! naïve café 🙂👍🏽 done"  # 2-, 3- and 4-byte characters, and a skin-tone sequence


class CountingTokenizer:
    """A byte-level BPE tokenizer (every UTF-8 byte a token, as GPT-2's and SmolLM2's split unknown
    characters) that counts the ids it is asked to decode."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        self.inner = PreTrainedTokenizerFast(tokenizer_object=raw)
        self.decoded_ids = 0

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False)

    def decode(self, ids, **kw) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kw)


@pytest.fixture(scope="module")
def tokenizer() -> CountingTokenizer:
    return CountingTokenizer()


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_pieces_add_up_to_the_whole_decode_without_broken_characters(tokenizer, chunk) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters really span several tokens here
    half = len(TEXT[:TEXT.index("世")].encode()) + 1  # ids are bytes here: one byte into a 3-byte character
    assert REPLACEMENT_CHAR in tokenizer.decode(ids[:half])
    detok = Detokenizer(tokenizer)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(pieces) + detok.flush() == TEXT == tokenizer.decode(ids)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_an_incomplete_character_at_the_end_comes_out_only_on_flush(tokenizer) -> None:
    ids = tokenizer.encode("ab🙂")
    detok = Detokenizer(tokenizer)
    assert detok.add(ids[:2]) == "ab"
    assert detok.add(ids[2:-1]) == ""           # the emoji's last byte is missing: held back
    assert detok.flush() == tokenizer.decode(ids[2:-1]) and REPLACEMENT_CHAR in tokenizer.decode(ids[2:-1])
    assert detok.flush() == ""


def test_cost_is_linear_in_the_answer(tokenizer) -> None:
    ids = tokenizer.encode(TEXT * 8)
    detok = Detokenizer(tokenizer)
    tokenizer.decoded_ids = 0
    text = "".join(detok.add([i]) for i in ids)
    assert text == TEXT * 8
    # each id is decoded a few times (as new, then as context), never the whole prefix per token
    assert tokenizer.decoded_ids <= 8 * len(ids), tokenizer.decoded_ids
