"""`kvsplice deploy`: N `kvsplice serve` replicas sharing one Redis tier, behind vLLM's router.

The router is `vllm-router` (PyPI `vllm-router`, a Rust load balancer over OpenAI-compatible workers):
it probes only /health and /v1/models, which every kvsplice server answers, passes kvsplice's request
fields (documents, cache_salt, return_token_ids) through untouched, retries a request whose worker
cannot be reached on another one, and takes a worker a health check finds dead out of rotation.
sglang-router also works, but probes four info endpoints (/server_info, /get_server_info, ...) that
kvsplice does not serve. docs/routing.md says what each policy sees of segment reuse.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvsplice.bench.server_process import Served, free_port, redis_server, serve_process, stop, wait_until_up
from kvsplice.errors import ConfigError

# vllm-router's policies that need nothing from the workers but HTTP (kv_aware also needs a render
# endpoint and KV events encoded as maps, which kvsplice does not serve: docs/routing.md).
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random", "consistent_hash")
# How often the router checks a worker's /health (s), and after how many failures it stops sending
# to it: a killed replica leaves rotation within about a second; until then the router's retries
# move the requests it cannot connect to onto another worker.
HEALTH_INTERVAL_S = 1
HEALTH_FAILURES = 1


@dataclass(frozen=True)
class Deployment:
    """A running deployment: clients talk to `url` (the router), which speaks the OpenAI API."""

    url: str
    replicas: tuple[Served, ...]
    store_url: str
    policy: str


def router_command(worker_urls: list[str], policy: str, port: int) -> list[str]:
    """The `vllm-router` command line for `worker_urls`; raises ConfigError if it is not installed or
    `policy` is not one this deployment supports."""
    if policy not in POLICIES:
        raise ConfigError(f"router policy {policy!r}: choose from {', '.join(POLICIES)}")
    # The console script sits beside this interpreter in a virtual environment that is not activated.
    binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if binary is None:
        raise ConfigError("vllm-router is not installed: pip install 'vllm-router==0.1.17'")
    return [
        binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--worker-urls", *worker_urls,
        # Its own metrics port defaults to 29000: two routers on one machine would collide.
        "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--log-level", "warning",
    ]  # fmt: skip


@contextlib.contextmanager
def router(
    worker_urls: list[str], policy: str, port: int | None = None, log: Path | None = None,
    startup_s: float = 60.0,
) -> Iterator[str]:  # fmt: skip
    """Start vllm-router over `worker_urls` (all up already), its output to `log` (None: this process's),
    yield its base URL once it answers, stop it on exit. Raises if it exits or does not answer within
    `startup_s`."""
    port = port or free_port()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("ab")) if log is not None else None
        process = subprocess.Popen(router_command(worker_urls, policy, port), stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, lambda: _answers(url), "vllm-router", startup_s, poll_s=0.2)
        yield url
    finally:
        stop(process, timeout_s=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def deploy(
    replicas: int, serve_flags: list[str], policy: str, store_url: str | None = None,
    port: int | None = None, router_log: Path | None = None,
) -> Iterator[Deployment]:  # fmt: skip
    """Start a redis-server (unless `store_url` names one), `replicas` servers with `serve_flags` and
    the store, and the router (its output to `router_log`, None: this process's); yield the deployment;
    stop everything on exit, in reverse order."""
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if "--store-url" in serve_flags:
        raise ConfigError("the replicas share the deployment's store: give --store-url to deploy, not serve")
    with contextlib.ExitStack() as stack:
        if store_url is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsplice-redis-"))
            store_url = stack.enter_context(redis_server(Path(directory)))
        flags = [*serve_flags, "--store-url", store_url]
        # One after another: loading the model on every core at once is no faster on a small machine.
        served = tuple(stack.enter_context(serve_process(flags)) for _ in range(replicas))
        url = stack.enter_context(router([s.url for s in served], policy, port, router_log))
        yield Deployment(url, served, store_url, policy)


def add_deploy_command(commands: argparse._SubParsersAction) -> None:
    """Register `deploy` on the CLI's subcommands."""
    parser = commands.add_parser(
        "deploy",
        help="run N kvsplice servers sharing one Redis tier behind vllm-router (docs/routing.md)",
        description="Start redis-server (or use --store-url), N `kvsplice serve` replicas and "
        "vllm-router in front of them; stop them all on Ctrl-C. Flags after `--` go to every replica.",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's policy")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--store-url", default=None, help="a Redis the replicas share (default: start one)")
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then `kvsplice serve` flags")
    parser.set_defaults(run=_deploy)


def _deploy(args: argparse.Namespace) -> None:
    flags = args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags
    with deploy(args.replicas, flags, args.policy, args.store_url, args.port) as running:
        for replica in running.replicas:
            print(f"[deploy] replica {replica.url} (pid {replica.process.pid})", file=sys.stderr)
        print(f"[deploy] store {running.store_url}", file=sys.stderr)
        print(f"[deploy] router {running.url} ({running.policy}); Ctrl-C stops everything", file=sys.stderr)
        # SIGTERM too unwinds the stack, so every process started is stopped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.pause()
