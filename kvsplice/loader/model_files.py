"""Where a model's files are: a Hugging Face directory, a GGUF file (converted once), or the default model."""

from __future__ import annotations

from pathlib import Path

from kvsplice.errors import ModelLoadError


def resolve_model_dir(model: str | None) -> Path:
    """The Hugging Face-style directory to load `model` from; None means the default Gemma 3 270M."""
    from kvsplice.loader.gguf import convert_gguf, default_model_path

    if model is None:
        return convert_gguf(default_model_path())
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.exists():
        raise ModelLoadError(f"{model} is neither a model directory nor a .gguf file")
    raise ModelLoadError(f"model path {model} does not exist (kvsplice loads local files only, never a hub)")
