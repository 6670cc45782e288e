"""The real server refusing what it must refuse: malformed and unsupported requests (raw httpx and the
`openai` client), a full queue, an engine failure, a wrong API key. Each error is OpenAI-shaped and
the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.server.config import ServerConfig
from kvsplice.server.launch import ServerThread
from tests.server_support import engine_of, wait_idle

pytestmark = pytest.mark.slow


# -- errors ---------------------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[dict[str, Any], int]] = [
    ({"model": "gpt-4", "prompt": "hi"}, 404),
    ({"prompt": "hi", "temperature": -1}, 400),
    ({"prompt": "hi", "temperature": "hot"}, 400),
    ({"prompt": "hi", "top_p": 0}, 400),
    ({"prompt": "hi", "top_p": 1.5}, 400),
    ({"prompt": "hi", "top_k": -2}, 400),
    ({"prompt": "hi", "max_tokens": 0}, 400),
    ({"prompt": "hi", "max_tokens": -3}, 400),
    ({"prompt": "hi", "max_tokens": 1.5}, 400),
    ({"prompt": "hi", "n": 2}, 400),
    ({"prompt": "hi", "best_of": 3}, 400),
    ({"prompt": "hi", "logprobs": 2}, 400),
    ({"prompt": "hi", "echo": True}, 400),
    ({"prompt": "hi", "presence_penalty": 0.5}, 400),
    ({"prompt": "hi", "stop": [""]}, 400),
    ({"prompt": "hi", "stop": 5}, 400),
    ({"prompt": "hi", "seed": 2**70}, 400),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ({"prompt": "hi", "repair": "magic"}, 400),
    ({"prompt": "hi", "recompute_ratio": 2}, 400),
    ({"prompt": "hi", "cache_salt": 5}, 400),
    ({"prompt": "hi", "repair_fallback_margin": -0.01}, 400),
    ({"prompt": "hi", "repair_fallback_margin": 0.05}, 200),
    ({"prompt": "hi", "repair_fallback_margin": True}, 400),
    ({"prompt": "hi", "recompute_ratio": "0.5"}, 400),
    ({"prompt": "hi", "max_tokens": True}, 400),
    ({"prompt": "hi", "temperature": 0}, 200),
    ({}, 400),
    ({"prompt": ""}, 200),
    ({"prompt": []}, 400),
    ({"prompt": [10**9]}, 400),
    ({"prompt": [-1]}, 400),
    ({"prompt": [2] * 20000}, 400),
    ({"prompt": "hi", "max_tokens": 10**9}, 400),
    ({"prompt": [{"segment": ""}]}, 400),
    ({"prompt": [{"segment": "a", "text": "b"}]}, 400),
    ({"prompt": [{"segment": [10**9]}]}, 400),
    ({"prompt": [{"sgment": "typo"}]}, 400),
    ({"prompt": [{"segment": "only a segment"}]}, 200),
    ({"prompt": [{"segment": "twice"}, {"segment": "twice"}]}, 200),
    ({"prompt": "\ud800"}, 400),
    ({"prompt": "hi", "temperature": 1e-30, "max_tokens": 1}, 200),
]

BAD_CHATS: list[tuple[dict[str, Any], int]] = [
    ({"messages": []}, 400),
    ({"messages": "hi"}, 400),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400),
    ({"messages": [{"role": "wizard", "content": "a"}]}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ({"messages": [{"role": "user", "content": "a"}], "documents": "doc"}, 400),
    ({"messages": [{"role": "user", "content": "a"}], "documents": [""]}, 400),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, 400),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, 400),
    ({"messages": [{"role": "user", "content": "a " * 20000}]}, 400),
]


def test_bad_requests_get_openai_errors(server: ServerThread) -> None:
    cases = [("/v1/completions", body, status) for body, status in BAD_COMPLETIONS]
    cases += [("/v1/chat/completions", body, status) for body, status in BAD_CHATS]
    raw = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b"", 400),
        ("/v1/completions", b"\xff\xfe", 400),
        ("/v1/chat/completions", b'{"messages": [' * 10000, 400),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
        ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400),
    ]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for path, body, status in cases:
            body = {"max_tokens": 2, **body}
            r = http.post(path, content=json.dumps(body).encode())
            assert r.status_code == status, (body, r.text)
            if status != 200:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        for path, content, status in raw:
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (content[:40], r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
            r = http.request(method, path)
            assert r.status_code == status and r.json()["error"]["message"]
        assert http.get("/health").status_code == 200


def test_errors_through_the_openai_client(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[2] * 20000, max_tokens=1)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)


# -- a small server: full queue, engine failure, API key ------------------------------------------


@pytest.fixture
def small_server(default_model_dir: Path) -> Iterator[ServerThread]:
    engine = Engine(EngineConfig(kv_cache_gb=0.02, max_num_seqs=1, max_waiting=0))
    with ServerThread(engine, ServerConfig(api_key="secret", retry_after_s=2)) as running:
        yield running


def test_full_queue_engine_failure_and_api_key(small_server: ServerThread) -> None:
    url = small_server.url + "/v1"
    client = openai.OpenAI(base_url=url, api_key="secret", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    model = client.models.list().data[0].id

    # One request runs (max_num_seqs=1) and none may wait (max_waiting=0): the next is refused at once.
    stream = client.completions.create(
        model=model, prompt="Count:", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    assert err.value.response.headers["retry-after"] == "2"
    assert time.monotonic() - start < 30
    stream.close()
    wait_idle(small_server)

    # A bug in the engine fails the request in flight with a 500; the server keeps serving.
    engine = engine_of(small_server)

    def broken_step() -> list:
        raise RuntimeError("injected engine bug")

    engine.step = broken_step  # type: ignore[method-assign]
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=model, prompt="hi", max_tokens=2)
    finally:
        del engine.step  # type: ignore[method-assign]
    r = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert httpx.get(small_server.url + "/health").status_code == 200
    wait_idle(small_server)


def test_cli_has_serve() -> None:
    from kvsplice.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "0", "--max-num-seqs", "4", "--api-key", "k"])
    assert ServerConfig.from_args(args) == ServerConfig(port=0, api_key="k")
    assert EngineConfig.from_args(args).max_num_seqs == 4
