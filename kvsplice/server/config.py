"""The server's own settings (the engine's are EngineConfig's); `kvsplice serve` builds both from flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvsplice.errors import ConfigError


def _opt(help_text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": help_text}, **kwargs)


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("address to listen on", default="127.0.0.1")
    port: int = _opt("port to listen on", default=8000)
    served_model_name: str | None = _opt(
        "the model name clients send (default: --model as given, or the default model's file name)",
        default=None,
    )
    api_key: str | None = _opt("when set, /v1 requests must send 'Authorization: Bearer <key>'", default=None)
    default_max_tokens: int = _opt(
        "max_tokens of a chat request that gives none (KV for it is reserved at admission)", default=512
    )
    retry_after_s: int = _opt("the Retry-After a client is told when the queue is full", default=1)
    log_level: str = _opt("uvicorn's log level", default="info")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens must be >= 1")
        if self.retry_after_s < 0:
            raise ConfigError("retry_after_s must be >= 0")
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("served_model_name must not be empty")

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add one --option per field to a CLI parser."""
        for f in dataclasses.fields(ServerConfig):
            kind = {"int": int}.get(str(f.type), str)
            parser.add_argument(
                "--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"]
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
