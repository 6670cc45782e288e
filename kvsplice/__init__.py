"""kvsplice: an LLM inference engine that reuses KV cache beyond prefixes."""

from kvsplice.config import EngineConfig
from kvsplice.errors import (
    InvalidRequestError,
    KvspliceError,
    ModelLoadError,
    OutOfBlocksError,
    PromptTooLongError,
    QueueFullError,
)
from kvsplice.llm import LLM
from kvsplice.options import RequestOptions
from kvsplice.outputs import RequestMetrics, RequestOutput
from kvsplice.prompt import Segment
from kvsplice.sampling import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "InvalidRequestError",
    "KvspliceError",
    "ModelLoadError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestMetrics",
    "RequestOptions",
    "RequestOutput",
    "SamplingParams",
    "Segment",
]
