"""Stop strings: the streaming matcher (KMP automata, O(new text) per piece) equals the plain
definition beside it (``find_stop_reference``) however the text is split, and a Sequence
releases exactly the text the definition allows: cut before the stop string that completes
first, a possible stop prefix and an incomplete UTF-8 character held back."""

import codecs

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deployments.engine import FinishReason, GenerationRequest, Sequence
from deployments.engine.sequence import StopStringMatcher, find_stop_reference
from model.tokenizer import ByteTokenizer

ALPHABET = "ab\n€é😀"  # few letters: stops overlap and recur; 2-, 3- and 4-byte characters
texts = st.text(ALPHABET, max_size=40)
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4).map(tuple)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=600, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 40), max_size=8))
@example(text="xxabcd", stops=("abcd", "bc"), cuts=[3])  # "bc" completes first, inside the longer one
@example(text="abcd", stops=("bcd", "abcd"), cuts=[])  # both complete at "d": the longer (earlier) wins
@example(text="aaab", stops=("aab",), cuts=[1, 2])  # a failed partial match restarts inside itself
@example(text="stop", stops=("stop",), cuts=[])  # at the very start
@example(text="ab€", stops=("€",), cuts=[2])
def test_matcher_equals_the_reference_however_the_text_is_split(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    seen = ""
    for piece in split(text, cuts):
        seen += piece
        cut = matcher.feed(piece)
        ref_cut, ref_held = find_stop_reference(seen, stops)
        assert cut == ref_cut, (seen, stops)
        if cut is not None:
            return
        assert matcher.held_back == ref_held, (seen, stops)
    assert find_stop_reference(text, stops)[0] is None


def test_matcher_refuses_text_after_the_stop_and_empty_stops():
    matcher = StopStringMatcher(("b",))
    assert matcher.feed("ab") == 1
    with pytest.raises(RuntimeError, match="after the stop string was found at 1"):
        matcher.feed("c")
    with pytest.raises(ValueError, match=r"non-empty, got \('x', ''\)"):
        StopStringMatcher(("x", ""))


def released_by_definition(data: bytes, stops: tuple[str, ...]) -> tuple[str, bool]:
    """What a stream may have released after ``data`` (output bytes so far) and whether it stopped."""
    complete = codecs.getincrementaldecoder("utf-8")().decode(data)  # an incomplete last character stays out
    cut, held = find_stop_reference(complete, stops)
    return (complete[:cut], True) if cut is not None else (complete[: len(complete) - held], False)


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_lists)
@example(text="a€b😀ab", stops=("😀a", "€bb"))
@example(text="ééé", stops=("éé",))
def test_sequence_releases_exactly_what_the_definition_allows(text, stops):
    data = text.encode()
    seq = Sequence(GenerationRequest("s", [72, 105], 1000, stop=stops, ignore_eos=True), ByteTokenizer(), max_model_len=2000)
    released = ""
    for i, byte in enumerate(data, 1):
        seq.append_token(byte)
        released += seq.take_output().new_text
        expected, stopped = released_by_definition(data[:i], stops)
        assert released == expected and (seq.finish_reason is FinishReason.STOP) == stopped, (data[:i], stops)
        if stopped:
            assert seq.text == expected
            return
    assert seq.finish_reason is None


def test_a_stop_string_longer_than_any_piece_spans_many_tokens():
    stop = "€" * 300 + "!"
    seq = Sequence(GenerationRequest("s", [72], 5000, stop=(stop,), ignore_eos=True), ByteTokenizer(), max_model_len=6000)
    released = ""
    for byte in ("ok" + "€" * 400 + "!tail").encode():
        seq.append_token(byte)
        released += seq.take_output().new_text
        if seq.finish_reason is not None:
            break
    assert released == "ok" + "€" * 100 and seq.finish_reason is FinishReason.STOP


def test_the_stop_that_completes_first_wins_also_inside_one_token():
    """One token ("<|eos|>" with ignore_eos) holds both stops: "|e" completes before the longer
    one that starts earlier, as it would if the same text came one byte per token."""
    tok = ByteTokenizer()
    seq = Sequence(GenerationRequest("s", [72], 50, stop=("<|eos|>", "|e"), ignore_eos=True), tok, max_model_len=100)
    seq.append_token(tok.eos_token_id)
    assert seq.text == "<" and seq.finish_reason is FinishReason.STOP
