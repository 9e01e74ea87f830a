"""A GGUF file's header, its metadata and tensor directory, read in one pass over a memory map.

`gguf.GGUFReader` makes a numpy view for every element of an array field, and a tokenizer's
vocabulary and merges are arrays of tens of thousands of strings (docs/benchmarks.md has the
times). The layout is llama.cpp's (versions 2 and 3, little-endian); the constants (value and block
types, block sizes) are the `gguf` package's. Each tensor's data is a view of the map shaped as
`GGUFReader` shapes it: the dimensions in numpy's order, and a block type's as rows of bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)
_SCALARS = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
            GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
            GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
            GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?"}
# Types whose data is an array of numbers; the others are blocks, read as bytes.
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One tensor of the directory. `shape` in GGUF's order (the fastest-varying dimension first);
    `data` in numpy's, a block type's last dimension in bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads values one after another from a memoryview (slicing a numpy memmap is far slower)."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.at = 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def skip(self, nbytes: int) -> int:
        """Where the next `nbytes` start; past them after."""
        if self.at + nbytes > len(self.buffer):
            raise ValueError("its header ends before its directory does (a truncated file?)")
        self.at += nbytes
        return self.at - nbytes

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        start = self.skip(n)
        return str(self.buffer[start:self.at], "utf-8")

    def value(self, kind: int):
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, n = self.unpack("<IQ")
            if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                return [self.value(item) for _ in range(n)]
            dtype = np.dtype(_SCALARS[GGUFValueType(item)])
            return np.frombuffer(self.buffer, dtype, n, self.skip(n * dtype.itemsize)).tolist()
        dtype = np.dtype(_SCALARS[kind])
        return np.frombuffer(self.buffer, dtype, 1, self.skip(dtype.itemsize)).item()


def read_header(path: str) -> tuple[dict, list[StoredTensor]]:
    """(metadata: key -> value, arrays as lists; the tensors in the file's order). Raises ValueError
    for a file that is not a GGUF file this reader knows, or whose header runs past its end."""
    buffer = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(buffer))
    try:
        magic, version = cursor.unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError("not a GGUF file (its first bytes are not GGUF's magic)")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file; jaxrunner reads little-endian ones (llama.cpp's default)")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}; jaxrunner reads versions {', '.join(map(str, VERSIONS))}")
        num_tensors, num_fields = cursor.unpack("<QQ")
        metadata = {}
        for _ in range(num_fields):
            key = cursor.string()
            (kind,) = cursor.unpack("<I")
            if key in metadata:
                raise ValueError(f"its metadata holds {key!r} twice")
            metadata[key] = cursor.value(kind)
        directory = []
        for _ in range(num_tensors):
            name = cursor.string()
            (n_dims,) = cursor.unpack("<I")
            dims = cursor.unpack(f"<{n_dims}Q")
            kind, offset = cursor.unpack("<IQ")
            directory.append((name, dims, GGMLQuantizationType(kind), offset))
    except (struct.error, OverflowError, RecursionError):  # a count or length past any file, arrays nested without end
        raise ValueError("its header ends before its directory does, or holds impossible sizes "
                         "(a truncated or damaged file?)") from None
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
    if len({name for name, *_ in directory}) < len(directory):
        raise ValueError("its directory names a tensor twice")
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in directory:
        numpy_dims = tuple(reversed(dims))
        count = math.prod(dims)
        if kind in _ELEMENTS:
            dtype = np.dtype(_ELEMENTS[kind])
            nbytes = count * dtype.itemsize
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            dtype, nbytes = np.dtype(np.uint8), count // block * block_bytes
            numpy_dims = quant_shape_to_byte_shape(numpy_dims, kind)
        first = start + offset
        if first + nbytes > buffer.size:
            raise ValueError(f"tensor {name!r} runs past the file's end (a truncated file?)")
        tensors.append(StoredTensor(name, kind, dims, buffer[first:first + nbytes].view(dtype).reshape(numpy_dims)))
    return metadata, tensors
