"""A GGUF file's header, read directly: its metadata values and its tensor table, the data memory-mapped.

`gguf.GGUFReader` makes numpy views for every element of every metadata array, which for Gemma 3's
262144-token vocabulary (tokens, scores, token types) took 22 s on a 2-core machine; this reads the
same header with `struct`, each array of numbers as one `np.frombuffer`, in 0.5 s. Values come out
as `GGUFReader`'s `contents()` gives them, except that a nested array stays nested.

Layout (all little-endian, or all big-endian): magic b"GGUF", u32 version (2 or 3), u64 tensor
count, u64 key count; then each key (string), u32 value type, value; then each tensor's name, u32
number of dims, u64 dims (fastest axis first), u32 ggml type, u64 offset into the data section,
which starts at the next multiple of `general.alignment` (default 32). A string is a u64 length
and UTF-8 bytes; an array is a u32 element type, a u64 length and the elements.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, Literal, NamedTuple

import gguf
import numpy as np

# GGUF value types (gguf.GGUFValueType) of fixed size -> struct / numpy type codes.
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_GGML_TYPES = frozenset(int(ggml_type) for ggml_type in gguf.GGMLQuantizationType)
# ggml types stored as plain numbers; the rest are quantised blocks, read as bytes.
_PLAIN_TENSORS = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GgufTensor(NamedTuple):
    """One tensor of the file, its data a read-only view of the memory-mapped file."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: fastest axis first
    n_elements: int
    # Reversed (row-major) shape; for a quantised type the last axis is bytes per row.
    data: np.ndarray


class GgufFile(NamedTuple):
    metadata: dict[str, Any]  # key -> int, float, bool, str, or a list of them
    tensors: list[GgufTensor]


def read_gguf(path: Path) -> GgufFile:
    """Parse the header of the GGUF at `path`; `ValueError` (or `struct.error`) for malformed bytes."""
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # stays open while views use it
    header = _Header(mapped)
    magic, version = struct.unpack_from("<4sI", mapped)
    if magic != b"GGUF":
        raise ValueError(f"GGUF magic invalid: {magic!r}")
    if not version & 0xFFFF:  # written on a machine of the other byte order
        header.order = ">"
        version = struct.unpack_from(">I", mapped, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    header.position = 8
    tensor_count, key_count = header.take("Q"), header.take("Q")

    metadata: dict[str, Any] = {}
    for _ in range(key_count):
        key, value_type = header.string(), header.take("I")
        if key in metadata:
            raise ValueError(f"duplicate metadata key {key!r}")
        if key == "general.alignment" and value_type != _UINT32:
            raise ValueError("general.alignment is not a u32")
        metadata[key] = header.value(value_type)

    table = []
    for _ in range(tensor_count):
        name = header.string()
        dims = header.take_all(f"{header.take('I')}Q")
        type_number = header.take("I")
        if type_number not in _GGML_TYPES:
            raise ValueError(f"tensor {name!r} has ggml type {type_number}, unknown to the gguf package")
        table.append((name, dims, gguf.GGMLQuantizationType(type_number), header.take("Q")))
    if len({name for name, *_ in table}) != len(table):
        raise ValueError("two tensors share a name")
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-header.position // alignment) * alignment

    tensors = []
    for name, dims, ggml_type, offset in table:
        n_elements = math.prod(dims)
        shape = tuple(reversed(dims))
        if ggml_type in _PLAIN_TENSORS:
            item_type, count = np.dtype(_PLAIN_TENSORS[ggml_type]).newbyteorder(header.order), n_elements
        else:
            item_type, shape = np.dtype(np.uint8), gguf.quants.quant_shape_to_byte_shape(shape, ggml_type)
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            count = n_elements * type_size // block_size
        begin = data_start + offset
        if begin + count * item_type.itemsize > len(mapped):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(mapped, item_type, count=count, offset=begin).reshape(shape)
        tensors.append(GgufTensor(name, ggml_type, dims, n_elements, data))
    return GgufFile(metadata, tensors)


class _Header:
    """A read position in the header; every read checks that the bytes are there."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.position = 0
        self.order: Literal["<", ">"] = "<"

    def take(self, code: str) -> Any:
        return self.take_all(code)[0]

    def take_all(self, code: str) -> tuple[Any, ...]:
        """The values that struct format `code` describes, e.g. "3Q" for three u64."""
        values = struct.unpack_from(self.order + code, self.buffer, self.position)
        self.position += struct.calcsize(self.order + code)
        return values

    def string(self) -> str:
        length = self.take("Q")
        end = self.position + length
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = self.buffer[self.position : end].decode("utf-8")
        self.position = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _NUMBERS:
            return self.take(_NUMBERS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type}")
        item_type, length = self.take("I"), self.take("Q")
        if item_type not in _NUMBERS:
            return [self.value(item_type) for _ in range(length)]
        dtype = np.dtype(_NUMBERS[item_type]).newbyteorder(self.order)
        if self.position + length * dtype.itemsize > len(self.buffer):
            raise ValueError("an array runs past the end of the file")
        values = np.frombuffer(self.buffer, dtype, count=length, offset=self.position)
        self.position += length * dtype.itemsize
        return values.tolist()
