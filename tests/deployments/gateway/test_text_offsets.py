"""``text_offset`` of completions' logprobs: characters of the text, for byte-level tokens that split
UTF-8 characters (deployments.gateway.http_ingress.TextOffsets)."""

from __future__ import annotations

from deployments.gateway.http_ingress import TextOffsets, _completion_logprobs
from deployments.gateway.protocol import TokenLogprobs


def _tokens(*pieces: bytes) -> list[TokenLogprobs]:
    return [TokenLogprobs(token=p.decode(errors="replace"), bytes=tuple(p), logprob=-1.0, top=()) for p in pieces]


def test_offsets_count_characters_of_the_text_not_token_strings():
    # "a", then "é" split in two tokens, "€" split 1 + 2, "b", an invalid byte, "c"
    pieces = (b"a", b"\xc3", b"\xa9x", b"\xe2", b"\x82\xac", b"b", b"\xff", b"c")
    text = b"".join(pieces).decode(errors="replace")
    assert text == "aéx€b\ufffdc"
    offsets = TextOffsets().of(_tokens(*pieces))
    assert offsets == [0, 1, 1, 3, 3, 4, 5, 6]
    assert all(0 <= o <= len(text) for o in offsets) and offsets == sorted(offsets)


def test_offsets_continue_across_stream_events_of_one_choice():
    pieces = (b"\xe2", b"\x82", b"\xac!", b"ok")
    one = TextOffsets()
    streamed = [_completion_logprobs(_tokens(p), one)["text_offset"][0] for p in pieces]
    assert streamed == TextOffsets().of(_tokens(*pieces)) == [0, 0, 0, 2]
    # the naive sum of token-string lengths would put "ok" at 4: each partial byte shows as one U+FFFD
    assert sum(len(t.token) for t in _tokens(*pieces[:3])) == 4
