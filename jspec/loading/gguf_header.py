"""A GGUF header, read and bounded in one walk.

``gguf.GGUFReader`` trusts the counts in a file, and builds Python and numpy objects for every
metadata array element (SmolLM2's 49,152 tokens and 48,900 merges: about 3 s). This walk reads
the header with ``struct`` and checks each count and length against the bytes left in the file
and against caps far above any real model, and each tensor's data range against the file size;
it keeps the scalar and string fields, notes where each array lies (decoded only when asked
for: :meth:`GGUFHeader.field`), and lists the tensors (name, dims, type, data offset).
Layout (GGUF v2/v3, little- or big-endian)::

    "GGUF" u32 version, u64 tensor_count, u64 kv_count
    kv_count x  (string key, u32 type, value)        string = u64 length + bytes
    tensor_count x (string name, u32 n_dims, n_dims x u64 dim, u32 ggml type, u64 offset)
    padding to ``general.alignment`` (default 32), then tensor data
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

from jspec.errors import CheckpointError

MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_ARRAY = 1 << 23  # elements of one metadata array (vocabularies and merges are < 10^6)
MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Walker:
    def __init__(self, path: Path, buf, order: str):
        self.path, self.buf, self.order, self.pos = path, buf, order, 0

    def fail(self, message: str):
        raise CheckpointError(f"{self.path}: corrupt GGUF header: {message}")

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            self.fail(f"truncated at byte {self.pos} (file has {len(self.buf)})")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, nbytes: int, what: str):
        if nbytes > len(self.buf) - self.pos:
            self.fail(f"{what} claims {nbytes} bytes at byte {self.pos}, the file has {len(self.buf) - self.pos} left")
        self.pos += nbytes

    def string(self, what: str) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n, what)
        return bytes(self.buf[start:self.pos])

    def value(self, vtype: int, key: str):
        """A scalar, a string (bytes) or an :class:`_Array` (where it lies); the walk checks it."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(f"string {key}")
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if count > MAX_ARRAY:
                self.fail(f"array {key} claims {count} elements (limit {MAX_ARRAY})")
            start = self.pos
            if itype in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[itype]), f"array {key}")
            elif itype == _STRING:
                if count * 8 > len(self.buf) - self.pos:
                    self.fail(f"array {key} claims {count} strings, more than the file can hold")
                for _ in range(count):  # the lengths only: no object per element
                    self.skip(self.take("Q"), f"array {key}")
            else:
                self.fail(f"array {key} has element type {itype} (nested arrays are not read)")
            return _Array(itype, count, start)
        self.fail(f"field {key} has unknown value type {vtype}")


class _Array(NamedTuple):
    itype: int  # element type
    count: int
    offset: int  # byte offset of the first element in the file


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    ggml_type: int
    offset: int  # of its data, from the start of the file


@dataclasses.dataclass
class GGUFHeader:
    """What :func:`check_gguf_header` read: metadata fields and tensor entries, bounds checked."""

    path: Path
    order: str  # struct byte order of the file: "<" or ">"
    fields: dict[str, Any]  # key -> scalar, bytes (a string) or an array's place in the file
    tensors: list[TensorInfo]

    def field(self, key: str, buf, default=None):
        """Field ``key`` as ``gguf.GGUFReader``'s ``contents()`` gives it (a string decoded, an
        array as a list), reading an array's elements from ``buf`` (the file's bytes)."""
        value = self.fields.get(key, default)
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if not isinstance(value, _Array):
            return value
        if value.itype in _SCALARS:
            fmt = _SCALARS[value.itype]
            return list(struct.unpack_from(f"{self.order}{value.count}{fmt}", buf, value.offset))
        out, pos = [], value.offset
        for _ in range(value.count):
            n = struct.unpack_from(self.order + "Q", buf, pos)[0]
            out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"))
            pos += 8 + n
        return out


def check_gguf_header(path: Path) -> GGUFHeader:
    """The header of a GGUF file; refuses (:class:`CheckpointError`) one whose counts, lengths or
    tensor ranges do not fit in the file, or that names a tensor twice."""
    import gguf

    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < 24:
                raise CheckpointError(f"{path}: not a GGUF file ({size} bytes)")
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    with buf:
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        w = _Walker(path, buf, order)
        w.pos = 4
        version = w.take("I")
        if version not in (2, 3):
            w.fail(f"version {version} (jspec reads GGUF 2 and 3)")
        n_tensors, n_kv = w.take("Q"), w.take("Q")
        if n_kv > MAX_KV or n_kv * 13 > size:
            w.fail(f"{n_kv} metadata fields")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > size:
            w.fail(f"{n_tensors} tensors")
        alignment = 32
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = w.string("a metadata key").decode("utf-8", "replace")
            vtype = w.take("I")
            value = w.value(vtype, key)
            fields[key] = value
            if key == "general.alignment":
                if vtype != 4 or not value or value & (value - 1):
                    w.fail(f"general.alignment must be a power-of-two u32, got {value!r}")
                alignment = value
        infos = []
        for _ in range(n_tensors):
            name = w.string("a tensor name").decode("utf-8", "replace")
            n_dims = w.take("I")
            if not 1 <= n_dims <= MAX_DIMS:
                w.fail(f"tensor {name} has {n_dims} dimensions")
            dims = [w.take("Q") for _ in range(n_dims)]
            infos.append((name, dims, w.take("I"), w.take("Q")))
        data_start = -(-w.pos // alignment) * alignment
        for name, dims, ttype, offset in infos:
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                w.fail(f"tensor {name} has unknown type {ttype}")
            count = 1
            for d in dims:
                count *= d
            if count % block or (dims[0] % block):
                w.fail(f"tensor {name} of shape {dims} is not a whole number of {block}-element blocks")
            nbytes = count // block * type_size
            if data_start + offset + nbytes > size:
                w.fail(f"tensor {name} ({nbytes} bytes at offset {offset}) runs past the end of the file "
                       f"({size} bytes)")
        if len({name for name, *_ in infos}) != len(infos):
            w.fail("a tensor name appears twice")
        return GGUFHeader(path, order, fields, [TensorInfo(name, tuple(dims), ttype, data_start + offset)
                                                for name, dims, ttype, offset in infos])
