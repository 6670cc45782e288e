"""A model directory's tokenizer: text <-> ids, the chat template, and streaming detokenization.

Reads a Hugging Face-style directory: tokenizer.json (the `tokenizers` model), tokenizer_config.json
(special tokens, add_bos_token, chat_template), and, when present, chat_template.jinja,
generation_config.json and config.json (which list the ids that end generation).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvsplice.errors import InvalidRequestError, ModelLoadError

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The special-token strings a chat template may use, as tokenizer_config.json names them.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    """Encodes and decodes text for one model; never adds BOS/EOS itself (see `add_bos`)."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos  # whether the model expects BOS at the start of a prompt
        self.chat_template = chat_template
        self._template_tokens = template_tokens
        self.special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        # Byte-fallback tokens ("<0xE2>"): a run of them is decoded as a whole (see IncrementalDecoder).
        self.byte_ids = (
            frozenset(i for token, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(token))
            if getattr(backend.model, "byte_fallback", False)
            else frozenset()
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of a model directory; `ModelLoadError` if it has no usable tokenizer.json."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{model_dir} has no tokenizer.json, so text cannot be encoded; pass token ids instead, "
                "or add the model's tokenizer.json"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")

        template_tokens = {
            name: token for name in _TEMPLATE_TOKENS if (token := _token_text(tokenizer_config.get(name)))
        }

        def token_id(name: str) -> int | None:
            return backend.token_to_id(template_tokens[name]) if name in template_tokens else None

        bos = token_id("bos_token")
        if bos is None:
            bos = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
        eos = {*_ids(generation_config.get("eos_token_id")), *_ids(model_config.get("eos_token_id"))}
        if (eos_token := token_id("eos_token")) is not None:
            eos.add(eos_token)
        if "add_bos_token" in tokenizer_config:
            add_bos = bool(tokenizer_config["add_bos_token"])
        else:  # no flag (Llama 3 style): BOS is added iff tokenizer.json's post-processor adds it
            add_bos = bos is not None and backend.encode("a").ids[:1] == [bos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos=add_bos and bos is not None,
            chat_template=_chat_template(model_dir, tokenizer_config),
            template_tokens=template_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, as the model was trained to see it (BOS included if
        the template writes it, so do not add another)."""
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._template_tokens
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        # As transformers renders chat templates: sandboxed, trimmed blocks, and the helpers templates use.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc


class IncrementalDecoder:
    """Detokenizes one stream of generated ids: `push` returns only text that is final.

    Concatenating every `push` and the closing `flush` gives exactly `tokenizer.decode(all_ids)`.
    Text is held back while it may still change:
    - during a run of byte-fallback tokens: the run is decoded as one UTF-8 string, and a single bad
      byte turns the whole run into U+FFFD, so its text is known only when a non-byte token ends it;
    - while the text ends in U+FFFD (byte-level BPE in the middle of a character).
    Each push re-decodes only a short window: the ids since the previous emission plus the ones
    before them as context (decoders such as Metaspace strip a leading space at the start).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window re-decoded on each push starts here
        self._read_offset = 0  # text of ids before this has been returned

    def push(self, token_id: int) -> str:
        """Add one generated id; the new text it completes (often "", never a partial character)."""
        # A skipped special token is invisible to decode(), so it must not end a byte run either.
        if self._skip and token_id in self._tokenizer.special_ids:
            return ""
        self._ids.append(token_id)
        if token_id in self._tokenizer.byte_ids:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back, once the stream has ended (U+FFFD for an unfinished character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if not final and (len(text) <= len(prefix) or text.endswith("\ufffd")):
            return ""
        assert text.startswith(prefix), f"decoding is not prefix-stable here: {prefix!r} -> {text!r}"
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` entry: absent, one id, or a list of ids."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # where newer transformers save it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # older multi-template form: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the chat template rejected these messages: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # transformers' version: unlike jinja2's own, it does not escape HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
