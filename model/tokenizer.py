"""Tokenizers: byte-level for the tiny models, Hugging Face `tokenizers` for real checkpoints.

Byte-level ids: 0..255 are raw bytes; the specials follow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids; specials are encoded when they appear literally in the text."""

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.eos_token_id = self.special_ids["<|eos|>"]
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(tok), tok) for tok in SPECIAL_TOKENS if tok in rest]
            if not hits:
                ids.extend(rest.encode("utf-8"))
                break
            pos, tok = min(hits)
            ids.extend(rest[:pos].encode("utf-8"))
            ids.append(self.special_ids[tok])
            rest = rest[pos + len(tok) :]
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        text: list[str] = []
        for i in ids:
            if not 0 <= i < BYTE_VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the byte vocabulary 0..{BYTE_VOCAB_SIZE - 1}")
            if i < 256:
                out.append(i)
            else:
                text.append(out.decode("utf-8", errors="replace"))
                out.clear()
                text.append(SPECIAL_TOKENS[i - 256])
        text.append(out.decode("utf-8", errors="replace"))
        return "".join(text)


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`) with the checkpoint's eos id."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        self.eos_token_id = None
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                self.eos_token_id = self._tok.token_to_id(eos)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer_from(path: Path) -> Tokenizer:
    """`tokenizer.json` when the directory has one, else the byte tokenizer."""
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    marker = path / "tokenizer_config.json"
    if marker.is_file():
        kind = json.loads(marker.read_text()).get("tokenizer_class")
        if kind not in (None, "ByteTokenizer"):
            raise ValueError(f"{marker}: tokenizer_class {kind!r} needs a tokenizer.json beside it")
    return ByteTokenizer()


def apply_chat_template(messages: list[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
    """ChatML-style template of the tiny models: each turn framed by <|im_start|>role … <|im_end|>,
    ending with an open assistant turn (``add_generation_prompt``). The text of the first k
    messages is a prefix of the text of all of them."""
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")
