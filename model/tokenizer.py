"""Tokenizers: byte-level for the tiny models, Hugging Face `tokenizers` for real checkpoints.

Byte-level ids: 0..255 are raw bytes; the specials follow.

User text is data: :meth:`Tokenizer.encode` never produces a control token, whatever the text
holds (a user who types ``<|im_end|>`` gets those bytes). Control tokens come only from
:meth:`Tokenizer.encode_with_specials`, which the chat template (:func:`encode_chat`) uses for
its own frame and a completion uses only when the client opts in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int  # token ids are 0 .. vocab_size - 1

    def encode(self, text: str) -> list[int]:
        """``text`` as plain data: literal special-token strings encode as ordinary text."""
        ...

    def encode_with_specials(self, text: str) -> list[int]:
        """``text`` with every literal special-token string encoded as that control token."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (logprobs report them: a byte token may be part of a character)."""
        ...


_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


class ByteTokenizer:
    """UTF-8 bytes as ids (:meth:`encode`); :meth:`encode_with_specials` also maps the literal
    special-token strings to their ids. Both run in time linear in the text."""

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.eos_token_id = self.special_ids["<|eos|>"]
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(self.special_ids[m.group()])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < BYTE_VOCAB_SIZE:
            raise ValueError(f"token id {token_id} is outside the byte vocabulary 0..{BYTE_VOCAB_SIZE - 1}")
        return bytes([token_id]) if token_id < 256 else SPECIAL_TOKENS[token_id - 256].encode("utf-8")

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
    """A `tokenizer.json` (Hugging Face `tokenizers`) with the checkpoint's eos id.

    Two instances of the same file: ``encode_special_tokens`` is a per-instance switch, and
    encoding may run on several threads at once (the ingress tokenizes off its event loop)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        self._plain = _Tok.from_file(str(path / "tokenizer.json"))
        self._plain.encode_special_tokens = True  # special-token strings in the text are split like any text
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
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


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
    """ChatML-style template of the tiny models, as text: each turn framed by <|im_start|>role …
    <|im_end|>, ending with an open assistant turn (``add_generation_prompt``). For display and
    logs only: tokenizing this text would read control tokens out of the messages; the request
    path uses :func:`encode_chat`."""
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def encode_chat(tokenizer: Tokenizer, messages: list[tuple[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`apply_chat_template`'s text where only the template's frame is control
    tokens: each ``role\ncontent`` encodes as plain data (:meth:`Tokenizer.encode`), so a message
    cannot close its turn or open a system turn. The ids of the first k messages are a prefix of
    the ids of all of them (the cache checkpoint at the end of a system prompt relies on it)."""
    start, end = tokenizer.encode_with_specials("<|im_start|>"), tokenizer.encode_with_specials("<|im_end|>")
    newline = tokenizer.encode("\n")
    ids: list[int] = []
    for role, content in messages:
        ids += start + tokenizer.encode(f"{role}\n{content}") + end + newline
    if add_generation_prompt:
        ids += start + tokenizer.encode("assistant\n")
    return ids


def stop_token_ids(tokenizer: Tokenizer, *, chat: bool) -> tuple[int, ...]:
    """End-of-sequence ids (and the end-of-turn marker for chat) for the byte tokenizer or an HF one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if chat:
        end = getattr(tokenizer, "special_ids", {}).get("<|im_end|>")
        if end is not None:
            ids.append(end)
    return tuple(ids)
