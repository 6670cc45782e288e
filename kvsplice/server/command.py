"""`kvsplice serve`: its flags (ServerConfig's, then EngineConfig's); the web stack loads when it runs."""

from __future__ import annotations

import argparse

from kvsplice.config import EngineConfig
from kvsplice.server.config import ServerConfig


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    """Register `serve` on the CLI's subcommands."""
    parser = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (see docs/server.md)",
        description="An OpenAI-compatible server with segment reuse: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics.",
    )
    ServerConfig.add_args(parser)
    EngineConfig.add_args(parser)
    parser.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:
    from kvsplice.server.launch import serve

    serve(EngineConfig.from_args(args), ServerConfig.from_args(args))
