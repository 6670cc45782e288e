"""The tokenizer built from the GGUF against transformers' own GGUF tokenizer, the chat template,
model-directory variants, and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsplice.errors import InvalidRequestError, ModelLoadError
from kvsplice.loader.gguf_tokenizer import GEMMA3_CHAT_TEMPLATE
from kvsplice.loader.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "def square(x):\n    return x ** 2  # squared\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "a  b   c    d     e",
    "  leading spaces and trailing   ",
    " one leading space",
    "\t\tindented\twith\ttabs\t",
    "line1\n\nline3\n\n\n\nline7\r\nwindows\r\n",
    "3.14159 2718281828 1,000,000 0x1F -42 1e-6",
    "I ❤️ 🦀 and 👩‍💻! 😀😀",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ 𓀀",  # byte fallback
    "naïve café résumé, e\u0301, a\u200bb, \x00\x07",
    "مرحبا بالعالم",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>text<eos> <pad><unk><mask> <unused5>",
    "[multimodal] <start_of_image><end_of_image>",
    "▁ a literal lower-one-eighth block ▁▁",
    "<0x41> looks like a byte token",
]
# Pieces that stress the tokenizer when glued together: specials, whitespace runs, byte fallback.
PIECES = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "[multimodal]", "<0x41>", "▁",
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "😀", "𝔘", "日本", "é", "e\u0301", "ab", "The",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(default_gguf_path: Path):
    """transformers' tokenizer built from the same GGUF (~23 s: it parses the vocabulary and rebuilds
    the merges in Python)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=6), st.sampled_from(PIECES)), max_size=10).map("".join))
def test_encode_equals_transformers_on_generated_text(tokenizer: Tokenizer, reference, text: str) -> None:
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)


def _id_lists(max_size: int = 40):
    """Ids of the real vocabulary, many of them byte-fallback (238..493), special or whitespace ones."""
    return st.lists(
        st.one_of(
            st.integers(238, 493),
            st.integers(0, 262_143),
            st.sampled_from([0, 1, 2, 3, 105, 106, 107, 108, 138, 139, 236743, 262_143]),
        ),
        max_size=max_size,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_id_lists(max_size=20))
def test_decode_equals_transformers_on_random_ids(tokenizer: Tokenizer, reference, ids: list[int]) -> None:
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_special_ids_and_flags(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.bos_token_id == 2
    assert tokenizer.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert tokenizer.add_bos is True
    assert tokenizer.vocab_size == len(reference) == 262_144
    ids = tokenizer.encode("hi")  # never adds BOS or EOS itself
    assert ids[0] != 2 and ids[-1] not in tokenizer.eos_token_ids


# ------------------------------------------------------------------------------------- chat template

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]
GEMMA_PROMPT = (
    "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nBye<end_of_turn>\n"
)


def test_chat_template_renders_gemma_turns(tokenizer: Tokenizer, reference) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATION)
    assert prompt == GEMMA_PROMPT + "<start_of_turn>model\n"
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False) == GEMMA_PROMPT
    # transformers renders the same template identically (same jinja settings and helpers).
    expected = reference.apply_chat_template(
        CONVERSATION, chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert prompt == expected
    # BOS comes from the template, as a special token.
    assert tokenizer.encode(prompt)[:3] == [2, 105, tokenizer.token_to_id("user")]


def test_chat_template_errors_are_request_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ------------------------------------------------------------------------------- model directories


@pytest.fixture
def hf_dir(default_model_dir: Path, tmp_path: Path) -> Path:
    """A directory laid out like a Hugging Face checkpoint, with its variations of the same facts."""
    (tmp_path / "tokenizer.json").symlink_to(default_model_dir / "tokenizer.json")
    bos = {"content": "<bos>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": "<eos>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 2}))
    return tmp_path


def test_hf_directory_variants(hf_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(hf_dir)
    assert tokenizer.bos_token_id == 2
    assert tokenizer.eos_token_ids == {1, 106, 50, 7}
    assert tokenizer.add_bos  # no add_bos_token flag: tokenizer.json's post-processor adds BOS
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATION)

    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(hf_dir).apply_chat_template(CONVERSATION[1:2]) == "[Hi there ]"


def test_directory_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load"):
        Tokenizer.from_dir(tmp_path)


# ----------------------------------------------------------------------------- streaming decoding


def _stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
    return [decoder.push(token_id) for token_id in ids], decoder.flush()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_id_lists())
def test_streamed_text_equals_decode_of_all(tokenizer: Tokenizer, ids: list[int]) -> None:
    for skip in (True, False):
        pieces, rest = _stream(tokenizer, ids, skip)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=skip)
        assert not any(piece.endswith("\ufffd") for piece in pieces)  # never a cut character


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=6), st.sampled_from(PIECES)), max_size=10).map("".join))
def test_streaming_valid_text_never_emits_a_broken_character(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces, rest = _stream(tokenizer, ids, skip=False)
    assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=False)
    assert not any("\ufffd" in piece for piece in [*pieces, rest])
    assert rest == "" or ids[-1] in tokenizer.byte_ids  # only a run still open at the end is held


def test_a_byte_run_is_held_until_it_ends(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("𓀀!")  # four byte tokens, then "!"
    assert len(ids) == 5
    pieces, rest = _stream(tokenizer, ids, skip=True)
    assert pieces == ["", "", "", "", "𓀀!"] and rest == ""

    # A valid "é" followed by a stray byte: the whole run decodes to U+FFFD, so "é" must not be
    # emitted early; a skipped special token in between does not end the run either.
    c3, a9, e2 = (tokenizer.token_to_id(byte) for byte in ("<0xC3>", "<0xA9>", "<0xE2>"))
    ids = [c3, a9, 106, e2, *tokenizer.encode("a")]
    pieces, rest = _stream(tokenizer, ids, skip=True)
    assert pieces[:4] == ["", "", "", ""]
    assert "".join(pieces) + rest == tokenizer.decode(ids) == "\ufffd\ufffd\ufffda"

    pieces, rest = _stream(tokenizer, [c3, a9], skip=True)
    assert pieces == ["", ""] and rest == "é"  # an unterminated run comes out on flush
