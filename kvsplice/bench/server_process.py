"""Real server processes for the benchmarks: `kvsplice serve` (for anything that must talk to the
server the way a client would) and a local redis-server (for the store's remote tier)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Served:
    """A running `kvsplice serve` process and its base URL."""

    url: str
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """Stop it the hard way (SIGKILL), as a crash would: nothing is flushed, requests are cut."""
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def serve_process(flags: list[str], startup_s: float = 300.0) -> Iterator[Served]:
    """Start `kvsplice serve <flags>` on a free port, wait until /health answers, yield it, and stop it
    on exit (if it still runs). Raises if the server exits or does not answer within `startup_s`."""
    port = free_port()
    command = [sys.executable, "-m", "kvsplice.cli", "serve", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen([*command, *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, lambda: _healthy(url), "the server", startup_s, poll_s=0.5)
        yield Served(url, process)
    finally:
        stop(process, timeout_s=60)


@contextlib.contextmanager
def serve(flags: list[str], startup_s: float = 300.0) -> Iterator[str]:
    """`serve_process`, yielding only the base URL."""
    with serve_process(flags, startup_s) as served:
        yield served.url


def wait_until_up(
    process: subprocess.Popen[bytes], answers: Callable[[], bool], what: str, startup_s: float, poll_s: float
) -> None:
    """Poll `answers` every `poll_s` until it is true; raise RuntimeError (naming `what`) if the process
    exits first or `startup_s` pass."""
    deadline = time.monotonic() + startup_s
    while not answers():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer in {startup_s:.0f} s")
        time.sleep(poll_s)


def pings(client: redis.Redis) -> bool:
    """Whether the Redis server answers a PING."""
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM (a server writes what it owes the tiers), SIGKILL if it has not exited in `timeout_s`."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def redis_server(directory: Path, maxmemory: str = "4gb", startup_s: float = 10.0) -> Iterator[str]:
    """Start redis-server on a free localhost port (no persistence, LRU within `maxmemory`), yield its
    URL, and stop it on exit. Raises if redis-server is not on PATH or does not answer in time."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
         "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)

    try:
        wait_until_up(process, lambda: pings(client), f"redis-server on port {port}", startup_s, poll_s=0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.kill()
        process.wait()
