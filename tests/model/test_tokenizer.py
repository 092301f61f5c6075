import pytest

from model import load_tokenizer
from model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo <|im_start|>user\nx = 1<|im_end|>"
    ids = tok.encode(text)
    assert ids[:2] == [ord("h"), 0xC3] and tok.special_ids["<|im_start|>"] in ids
    assert tok.decode(ids) == text
    assert max(ids) < BYTE_VOCAB_SIZE
    with pytest.raises(ValueError, match="token id 999"):
        tok.decode([999])


def test_load_tokenizer_for_presets():
    assert load_tokenizer("tiny-k3").encode("ab") == [97, 98]
    with pytest.raises(ValueError, match="'no-such-model'"):
        load_tokenizer("no-such-model")
