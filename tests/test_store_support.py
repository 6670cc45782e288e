"""Helpers shared by the store tests (no tests here): a small fingerprint, random segment KV, and a
real redis-server on a free localhost port in a temporary directory."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import torch

from kvsplice.bench.server_process import free_port, pings, wait_until_up
from kvsplice.tiers import KVFingerprint, SegmentKV

LAYERS, HEADS, DIM = 4, 2, 8


def fingerprint(**changes: object) -> KVFingerprint:
    fields: dict[str, object] = dict(
        model_hash="weights-a",
        tokenizer_hash="tok-a",
        compute_dtype="float32",
        kv_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        rope="full:theta=1e6;sliding:theta=1e4",
        context_tokens=(2, 7, 7, 9),
        segment_contexts=1,
    )
    fields.update(changes)
    return KVFingerprint(**fields)  # type: ignore[arg-type]


def random_kv(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [layers, tokens, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, num_tokens, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def segment(num_tokens: int, seed: int = 0) -> tuple[list[int], SegmentKV]:
    tokens = [(seed * 1000 + i) % 50_000 for i in range(num_tokens)]
    return tokens, SegmentKV.full(*random_kv(num_tokens, seed))


def assert_same_kv(a: SegmentKV, b: SegmentKV) -> None:
    assert a.num_tokens == b.num_tokens and len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.start == y.start
            assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def segment_files(directory: Path) -> list[Path]:
    """The disk tier's segment entries in `directory`, sorted (not the trust gate's record beside them)."""
    return sorted(p for p in directory.glob("*.kv") if not p.name.startswith("gate-"))


class RedisServer:
    """redis-server on 127.0.0.1:port, no persistence, started and stopped by the test."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not on PATH: apt-get install redis-server (.ci/run does, as root)")
        self.directory = directory
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            what = f"redis-server on port {self.port}"
            wait_until_up(self.process, lambda: pings(client), what, 10.0, poll_s=0.02)
        finally:
            client.close()
        return self

    def kill(self) -> None:
        """Stop it the hard way (SIGKILL), as a crash would."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(5)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
