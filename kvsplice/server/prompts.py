"""Prompts from HTTP requests: the completions `prompt` field and chat messages, segments included.

Completions `prompt` (OpenAI's forms, plus a list of parts):
    "text"                                   one prompt
    [1, 2, 3]                                one prompt of token ids, used verbatim
    ["text", ...] or [[1, 2], ...]           a batch: one choice per prompt
    [{"text": "..."}, {"segment": "..."}]    one prompt of parts; a part is {"text": str},
                                             {"token_ids": [int]} or {"segment": str | [int]}
    [[{"segment": ...}, ...], ...]           a batch of part lists

Chat: a text content part with `"kvsplice_segment": true` is a segment, and so is each entry of a
request's `documents`, placed at the start of the first user message, each followed by a blank line.
The conversation is rendered with the model's chat template, with a placeholder where each segment
goes; the rendered text is then cut at the placeholders into text parts and `Segment`s, so each
segment is tokenised on its own. The template's leading BOS text is dropped when the engine adds BOS
itself, so the prompt holds exactly one.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from kvsplice.errors import InvalidRequestError
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.prompt import Part, Prompt, Segment, bos_ids, is_token
from kvsplice.server.errors import BadRequest

_PART_KEYS = ("text", "token_ids", "segment")
CHAT_ROLES = ("system", "developer", "user", "assistant")


def completion_prompts(prompt: Any) -> list[Prompt]:
    """The prompts of a completions request: one, or several (a batch)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(
            "prompt must be a string, a list of token ids, a list of parts, or a non-empty list of those",
            param="prompt",
        )
    if all(is_token(t) for t in prompt):
        return [list(prompt)]
    if any(isinstance(p, dict) for p in prompt):
        return [_parts(prompt, "prompt")]
    prompts: list[Prompt] = []
    for i, item in enumerate(prompt):
        where = f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(is_token(t) for t in item):
            prompts.append(list(item))
        elif isinstance(item, list) and item and any(isinstance(p, dict) for p in item):
            prompts.append(_parts(item, where))
        else:
            raise BadRequest(
                f"{where} must be a string, a non-empty list of token ids or a list of parts",
                param=where,
            )
    return prompts


def _parts(items: list[Any], where: str) -> list[Part]:
    parts: list[Part] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if isinstance(item, str):
            parts.append(item)
            continue
        if not isinstance(item, dict) or len(item) != 1 or next(iter(item)) not in _PART_KEYS:
            raise BadRequest(
                f'{at} must be one of {{"text": str}}, {{"token_ids": [int]}}, {{"segment": str or [int]}}, '
                f"got {_short(item)}",
                param=at,
            )
        ((key, value),) = item.items()
        if key == "text" and isinstance(value, str):
            parts.append(value)
        elif key == "token_ids" and isinstance(value, list) and all(is_token(t) for t in value):
            parts.append(list(value))
        elif key == "segment" and (
            (isinstance(value, str) and value)
            or (isinstance(value, list) and value and all(is_token(t) for t in value))
        ):
            parts.append(Segment(value))
        else:
            expected = {
                "text": "a string",
                "token_ids": "a list of token ids",
                "segment": "a non-empty string or a non-empty list of token ids",
            }[key]
            raise BadRequest(f"{at}.{key} must be {expected}, got {_short(value)}", param=at)
    return parts


def chat_prompt(
    tokenizer: Tokenizer | None, messages: Any, documents: Any = None, add_generation_prompt: bool = True
) -> list[Part]:
    """The prompt of a chat request, as parts (text and Segments) ready for the engine."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so no chat template; use /v1/completions")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    # A placeholder nobody can type: a fresh nonce in private-use characters.
    nonce = uuid.uuid4().hex
    segments: list[str] = []

    def placeholder(text: str) -> str:
        segments.append(text)
        return f"\ue000{nonce}:{len(segments) - 1}\ue001"

    rendered_messages = [_message(m, i, placeholder) for i, m in enumerate(messages)]
    if documents is not None:
        docs = _documents(documents)
        first_user = next((m for m in rendered_messages if m["role"] == "user"), None)
        if first_user is None:
            raise BadRequest("documents need a user message to go in", param="documents")
        first_user["content"] = "".join(placeholder(d) + "\n\n" for d in docs) + first_user["content"]
    try:
        text = tokenizer.apply_chat_template(rendered_messages, add_generation_prompt=add_generation_prompt)
    except InvalidRequestError:
        raise
    except Exception as exc:  # a model's template may fail in any way on inputs it does not expect
        raise InvalidRequestError(f"the chat template failed on these messages: {exc!r}") from exc

    for bos in bos_ids(tokenizer):
        bos_text = tokenizer.backend.id_to_token(bos)
        if bos_text and text.startswith(bos_text):
            text = text[len(bos_text) :]  # the engine adds BOS itself
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
    # re.split with one group alternates: text, segment index, text, ...
    parts: list[Part] = []
    seen = set()
    for i, piece in enumerate(pieces):
        if i % 2:
            seen.add(int(piece))
            parts.append(Segment(segments[int(piece)]))
        elif piece:
            parts.append(piece)
    if len(seen) < len(segments):
        raise InvalidRequestError(
            "the model's chat template dropped a segment (for example one in a system message's second "
            "content part); put segments in user messages or `documents`"
        )
    if not parts:
        parts.append("")
    return parts


def _message(message: Any, i: int, placeholder: Any) -> dict[str, str]:
    at = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{at} must be an object with role and content", param=at)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(
            f"{at}.role must be one of {list(CHAT_ROLES)}, got {_short(role)}", param=f"{at}.role"
        )
    if message.get("tool_calls"):
        raise BadRequest("tool calls are not supported", param=f"{at}.tool_calls")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            texts.append(_content_part(part, f"{at}.content[{j}]", placeholder))
        text = "\n".join(texts)
    else:
        raise BadRequest(f"{at}.content must be a string or a list of text parts", param=f"{at}.content")
    # "developer" is OpenAI's newer name for "system"; templates know only the latter.
    return {"role": "system" if role == "developer" else role, "content": text}


def _content_part(part: Any, at: str, placeholder: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else None
        raise BadRequest(
            f"{at} must be a text part {{'type': 'text', 'text': ...}}; "
            f"{_short(kind)} parts are not supported by this server",
            param=at,
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{at}.text must be a string", param=f"{at}.text")
    flag = part.get("kvsplice_segment", False)
    if not isinstance(flag, bool):
        raise BadRequest(f"{at}.kvsplice_segment must be true or false", param=at)
    if flag:
        if not text:
            raise BadRequest(f"{at}: a segment's text is empty", param=f"{at}.text")
        return str(placeholder(text))
    return text


def _documents(documents: Any) -> list[str]:
    if not isinstance(documents, list):
        raise BadRequest("documents must be a list of strings", param="documents")
    docs = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str) or not doc:
            raise BadRequest(
                f"documents[{i}] must be a non-empty string (or {{'text': str}})", param=f"documents[{i}]"
            )
        docs.append(doc)
    return docs


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
