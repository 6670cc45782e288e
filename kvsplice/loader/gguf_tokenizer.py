"""The tokenizer of a GGUF: its vocabulary read from the metadata, rebuilt as a Hugging Face tokenizer.

Produces what `convert_gguf` writes for text: `tokenizer.json`, `tokenizer_config.json` (special
tokens, add_bos, the chat template; Gemma 3's when a gemma3 file has none) and
`generation_config.json` (the ids that end generation). Two kinds of vocabulary, as llama.cpp names
them in `tokenizer.ggml.model`:
- "llama": SentencePiece-style BPE with byte fallback (Gemma), whose merges are rebuilt from the vocabulary;
- "gpt2": byte-level BPE with the file's merges, split first by the pre-tokenizer that
  `tokenizer.ggml.pre` names (SmolLM2: "smollm").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from kvsplice.errors import ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how llama.cpp splits text before byte-level BPE. "smollm" (also StarCoder's):
# every digit on its own, then GPT-2's regex, which is what ByteLevel's own regex does.
_BYTE_LEVEL_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}

# Gemma 3's chat template, as google/gemma-3-*-it ship it in tokenizer_config.json; GGUFs often omit it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


# Chat templates for architectures whose GGUFs often omit theirs.
_DEFAULT_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer as a GGUF stores it: llama.cpp's key names, tokens spelled as in the file."""

    model: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str | None  # tokenizer.ggml.pre, the byte-level pre-tokenizer
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # byte-level BPE's, ranked, each "left right"; empty for SentencePiece
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_vocab(metadata: dict[str, Any], path: Path) -> GgufVocab:
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    merges: list[str] = []
    if model == "llama":
        # llama.cpp prepends a space unless told not to (Llama 2 does, Gemma does not); only the
        # Gemma kind is rebuilt here.
        if metadata.get("tokenizer.ggml.add_space_prefix", True):
            raise ModelLoadError(
                f"{path}: its SentencePiece vocabulary prepends a space to the text (Llama 2 style); "
                "kvsplice converts only SentencePiece vocabularies that do not (Gemma's)"
            )
    elif model == "gpt2":
        if pre not in _BYTE_LEVEL_PRE_TOKENIZERS:
            raise ModelLoadError(
                f"{path}: byte-level BPE with pre-tokenizer {pre!r} is not supported; kvsplice knows "
                f"{', '.join(map(repr, _BYTE_LEVEL_PRE_TOKENIZERS))}"
            )
        merges = metadata.get("tokenizer.ggml.merges") or []
        if not merges:
            raise ModelLoadError(f"{path} lacks the merges of its BPE vocabulary (tokenizer.ggml.merges)")
    else:
        raise ModelLoadError(
            f"{path}: tokenizer {model!r} is not supported; kvsplice converts 'llama' (SentencePiece) "
            "and 'gpt2' (byte-level BPE) vocabularies"
        )
    tokens, types = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        raise ModelLoadError(f"{path} lacks its vocabulary (tokenizer.ggml.tokens and token_type)")
    if len(tokens) != len(types):
        raise ModelLoadError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    return GgufVocab(
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        unk_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise, not for BPE.
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def generation_config(vocab: GgufVocab) -> dict[str, Any]:
    eos = [vocab.eos_id] if vocab.eos_id is not None else []
    # A chat turn ends with <end_of_turn>, not <eos>: Gemma's own generation_config and llama.cpp
    # both stop on it.
    if "<end_of_turn>" in vocab.tokens:
        eos.append(vocab.tokens.index("<end_of_turn>"))
    return {"bos_token_id": vocab.bos_id, "eos_token_id": eos, "pad_token_id": vocab.pad_id}


def tokenizer_config(vocab: GgufVocab, architecture: str) -> dict[str, Any]:
    def token(token_id: int | None) -> str | None:
        return vocab.tokens[token_id] if token_id is not None else None

    return {
        "bos_token": token(vocab.bos_id),
        "eos_token": token(vocab.eos_id),
        "pad_token": token(vocab.pad_id),
        "unk_token": token(vocab.unk_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "chat_template": vocab.chat_template or _DEFAULT_CHAT_TEMPLATES.get(architecture),
    }


def build_tokenizer(vocab: GgufVocab) -> HFTokenizer:
    """The Hugging Face tokenizer that tokenises as llama.cpp does with this vocabulary."""
    if vocab.model == "gpt2":
        backend, tokens = _byte_level_tokenizer(vocab), vocab.tokens
    else:
        backend, tokens = _sentencepiece_tokenizer(vocab)
    if vocab.add_bos and vocab.bos_id is not None:
        # For other readers of tokenizer.json; kvsplice's Tokenizer encodes without it and reports add_bos.
        bos = tokens[vocab.bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, vocab.bos_id)]
        )
    typed = list(zip(tokens, vocab.token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, kind in typed if kind == _CONTROL]
    )
    # SentencePiece's respelled space runs are left to BPE, which builds them from "▁" merges.
    # transformers does the same (it looks them up under their original spelling, finds nothing,
    # and adds none).
    respelled = {token for token, original in zip(tokens, vocab.tokens, strict=True) if token != original}
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == _USER_DEFINED and token not in respelled
        ]
    )
    return backend


def _sentencepiece_tokenizer(vocab: GgufVocab) -> tuple[HFTokenizer, list[str]]:
    """Gemma's tokenizer: SentencePiece-style BPE with byte fallback, and its tokens as it spells them.

    Spaces become "▁" before BPE and back after; no space is prepended. Control tokens (type 3)
    become special added tokens, user-defined ones (type 4, like "\\n\\n") plain added tokens matched
    whole, as llama.cpp does.
    """
    # Runs of 2+ spaces are stored as real spaces, but the normalizer turns text spaces into "▁",
    # so the vocabulary must spell them that way too.
    tokens = ["▁" * len(token) if len(token) > 1 and set(token) == {" "} else token for token in vocab.tokens]
    token_ids = {token: index for index, token in enumerate(tokens)}
    if len(token_ids) != len(tokens):
        raise ModelLoadError("the GGUF vocabulary spells some token twice")
    unk = tokens[vocab.unk_id] if vocab.unk_id is not None else None

    backend = HFTokenizer(
        BPE(token_ids, rebuild_merges(tokens, token_ids), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend, tokens


def _byte_level_tokenizer(vocab: GgufVocab) -> HFTokenizer:
    """GPT-2-style BPE: text as UTF-8 bytes spelled as printable characters (a space is "Ġ"), merged
    by the file's ranked merges, after the pre-tokenizer has split it into words."""
    token_ids = {token: index for index, token in enumerate(vocab.tokens)}
    if len(token_ids) != len(vocab.tokens):
        raise ModelLoadError("the GGUF vocabulary spells some token twice")
    merges = []
    for merge in vocab.merges:
        # A byte-level token never holds a real space, so the one space separates the two sides.
        left, space, right = merge.partition(" ")
        if not (left and space and right) or left + right not in token_ids:
            raise ModelLoadError(f"the GGUF's BPE merge {merge!r} does not join two tokens into a third")
        merges.append((left, right))
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    backend = HFTokenizer(BPE(token_ids, merges, unk_token=unk))
    assert vocab.pre is not None, "read_vocab checks the pre-tokenizer"
    backend.pre_tokenizer = _BYTE_LEVEL_PRE_TOKENIZERS[vocab.pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def rebuild_merges(tokens: list[str], token_ids: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists none: every split of a token into two tokens.

    Ranked by the merged token's position in the file (Gemma's scores do not follow merge order;
    the file order does), and within one token longest left piece first, as transformers ranks them.
    """
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in token_ids and right in token_ids:
                merges.append((left, right))
    return merges
