"""The tokenizer of a GGUF: its vocabulary read from the metadata, rebuilt as a Hugging Face tokenizer.

Produces what `convert_gguf` writes for text: `tokenizer.json` (SentencePiece-style BPE whose merges
are rebuilt from the vocabulary), `tokenizer_config.json` (special tokens, add_bos, Gemma 3's chat
template when the file has none) and `generation_config.json` (the ids that end generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from kvsplice.errors import ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

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


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer as a GGUF stores it: llama.cpp's key names, tokens spelled as in the file."""

    tokens: list[str]
    token_types: list[int]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_vocab(metadata: dict[str, Any], path: Path) -> GgufVocab:
    model = metadata.get("tokenizer.ggml.model")
    if model != "llama":
        raise ModelLoadError(
            f"{path}: expected a SentencePiece ('llama') tokenizer for gemma3, got {model!r}"
        )
    tokens, types = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        raise ModelLoadError(f"{path} lacks its vocabulary (tokenizer.ggml.tokens and token_type)")
    if len(tokens) != len(types):
        raise ModelLoadError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    return GgufVocab(
        tokens=tokens,
        token_types=types,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        unk_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise.
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
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


def tokenizer_config(vocab: GgufVocab) -> dict[str, Any]:
    def token(token_id: int | None) -> str | None:
        return vocab.tokens[token_id] if token_id is not None else None

    return {
        "bos_token": token(vocab.bos_id),
        "eos_token": token(vocab.eos_id),
        "pad_token": token(vocab.pad_id),
        "unk_token": token(vocab.unk_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "chat_template": vocab.chat_template or GEMMA3_CHAT_TEMPLATE,
    }


def build_tokenizer(vocab: GgufVocab) -> HFTokenizer:
    """Gemma's tokenizer from a GGUF vocabulary: SentencePiece-style BPE with byte fallback.

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
    # The respelled space runs are left to BPE, which builds them from "▁" merges. transformers does
    # the same (it looks them up under their original spelling, finds nothing, and adds none).
    respelled = {token for token, original in zip(tokens, vocab.tokens, strict=True) if token != original}
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == _USER_DEFINED and token not in respelled
        ]
    )
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
