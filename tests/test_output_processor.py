"""Stop strings, hold-back and finishing, on the default model's real tokenizer, against an oracle that
cuts the whole detokenised text at the first stop string."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvsplice.cache.base import CacheSeq
from kvsplice.engine.output import OutputProcessor
from kvsplice.engine.request import Request
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.options import RepairSettings
from kvsplice.prompt import ParsedPrompt
from kvsplice.sampling import SamplingParams

EOS = 1


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _stream(tokenizer: Tokenizer, text: str, params: SamplingParams) -> tuple[list[str], Request]:
    """Feed `text`'s tokens one by one; the streamed pieces and the finished request."""
    outputs = OutputProcessor(tokenizer, frozenset({EOS}), max_model_len=10_000)
    request = Request(
        "r",
        ParsedPrompt((2,)),
        params,
        RepairSettings("none", 0.0, None),
        None,
        CacheSeq("r", None, [2]),
        None,
    )
    outputs.add("r")
    pieces = []
    for token in tokenizer.encode(text):
        pieces.append(outputs.append(request, token).new_text)
        if request.finish_reason is not None:
            break
    return pieces, request


def _oracle(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> str:
    """vLLM's semantics, by brute force: after each token, the whole text so far is searched; the first
    token after which any stop string is in it ends the text, cut before the earliest one found then (a
    stop string that would start earlier but completes later never gets the chance)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        cuts = [i for s in stops if (i := text.find(s)) != -1]
        if cuts:
            return text[: min(cuts)]
    return tokenizer.decode(ids)


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("Paris is the capital.\nQuestion: what else?", ("\nQuestion:",), "Paris is the capital."),
        # A stop string's prefix is held back, then released when the text goes another way.
        ("The STORM came. STOP now.", ("STOP",), "The STORM came. "),
        # The earliest of several stop strings wins, whichever is listed first.
        ("alpha beta gamma delta", ("delta", "beta"), "alpha "),
        ("no stop string here at all", ("zzz",), "no stop string here at all"),
    ],
)
def test_stop_strings_cut_the_text_and_are_never_streamed(
    tokenizer: Tokenizer, text: str, stops: tuple[str, ...], expected: str
) -> None:
    params = SamplingParams(max_tokens=1000, stop=stops)
    pieces, request = _stream(tokenizer, text, params)
    assert "".join(pieces) == request.text == expected
    assert request.finish_reason == ("stop" if expected != text else None)
    # No prefix of what was streamed ever showed a stop string or ran past the cut.
    shown = ""
    for piece in pieces:
        shown += piece
        assert expected.startswith(shown) and not any(s in shown for s in stops)


def test_held_back_text_is_released_when_max_tokens_ends_the_request(tokenizer: Tokenizer) -> None:
    text = "It ends with STO"
    n = len(tokenizer.encode(text))
    pieces, request = _stream(tokenizer, text, SamplingParams(max_tokens=n, stop=("STOP",)))
    assert request.finish_reason == "length"
    assert "".join(pieces) == request.text == text


@example(text="X\nX", stops=["\n", "X\nX"])  # "\n" completes first: the text is "X", not ""
@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab .\nXY", min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet="ab .\nXY", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streamed_text_equals_the_oracle_cut(tokenizer: Tokenizer, text: str, stops: list[str]) -> None:
    pieces, request = _stream(tokenizer, text, SamplingParams(max_tokens=1000, stop=tuple(stops)))
    want = _oracle(tokenizer, tokenizer.encode(text), tuple(stops))
    assert request.text == want
    if request.finish_reason == "stop":
        assert "".join(pieces) == want
    else:
        # Still running: what may yet become a stop string is held back, nothing else.
        shown = "".join(pieces)
        assert want.startswith(shown) and len(want) - len(shown) < max(map(len, stops))
