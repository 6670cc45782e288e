"""The server's prompt markup without a model: completions prompt forms, chat segments, exactly one BOS."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.errors import InvalidRequestError
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.prompt import Segment, parse_prompt
from kvsplice.server.prompts import chat_prompt, completion_prompts


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        ([5, 6, 7], [[5, 6, 7]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([{"text": "Q: "}, {"segment": "doc"}], [["Q: ", Segment("doc")]]),
        (["Q: ", {"segment": [4, 5]}, {"token_ids": [9]}], [["Q: ", Segment((4, 5)), [9]]]),
        ([[{"segment": "a"}], "plain", [{"segment": "b"}]], [[Segment("a")], "plain", [Segment("b")]]),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: list) -> None:
    assert completion_prompts(prompt) == expected


@pytest.mark.parametrize(
    "prompt",
    [
        [],
        None,
        7,
        [{"segment": ""}],
        [{"segment": []}],
        [{"segment": 5}],
        [{"text": "a", "segment": "b"}],
        [{"document": "x"}],
        [{"token_ids": ["a"]}],
        [{"token_ids": [True]}],
        [["a", "b"]],
        [[]],
        [1.5],
        [None],
    ],
)
def test_bad_completion_prompts(prompt: object) -> None:
    with pytest.raises(InvalidRequestError):
        completion_prompts(prompt)


def test_chat_segments_become_segment_parts_with_one_bos(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Alpha document.", "kvsplice_segment": True},
                {"type": "text", "text": "What is alpha?"},
            ],
        },
    ]
    parts = chat_prompt(tokenizer, messages, documents=["Beta document."])
    segments = [p for p in parts if isinstance(p, Segment)]
    assert segments == [Segment("Beta document."), Segment("Alpha document.")]
    assert all("\ue000" not in p for p in parts if isinstance(p, str))
    # The same conversation with the segments as plain text renders to the same text.
    plain = tokenizer.apply_chat_template(
        [
            messages[0],
            {"role": "user", "content": "Beta document.\n\nAlpha document.\nWhat is alpha?"},
        ]
    )
    rendered = "".join(p.content if isinstance(p, Segment) else p for p in parts)  # type: ignore[misc]
    bos = tokenizer.backend.id_to_token(tokenizer.bos_token_id)
    assert plain == bos + rendered
    ids = parse_prompt(parts, tokenizer, tokenizer.vocab_size).token_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_segment_text_is_tokenised_on_its_own(tokenizer: Tokenizer) -> None:
    doc = "The quick brown fox jumps over the lazy dog."
    first = chat_prompt(tokenizer, [{"role": "user", "content": "Q?"}], documents=[doc])
    parsed = parse_prompt(first, tokenizer, tokenizer.vocab_size)
    (span,) = parsed.segments
    assert list(parsed.segment_tokens(span)) == tokenizer.encode(doc)


@pytest.mark.parametrize(
    ("messages", "documents"),
    [
        ([], None),
        ("hi", None),
        ([{"role": "robot", "content": "hi"}], None),
        ([{"role": "user"}], None),
        ([{"role": "user", "content": 5}], None),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "kvsplice_segment": "yes"}]}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "", "kvsplice_segment": True}]}], None),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None),
        ([{"role": "user", "content": "a"}], "not a list"),
        ([{"role": "user", "content": "a"}], [""]),
        ([{"role": "user", "content": "a"}], [3]),
        ([{"role": "system", "content": "a"}], ["doc"]),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], None),
    ],
)
def test_bad_chat_markup(tokenizer: Tokenizer, messages: object, documents: object) -> None:
    with pytest.raises(InvalidRequestError):
        chat_prompt(tokenizer, messages, documents)
