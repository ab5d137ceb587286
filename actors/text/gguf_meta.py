"""Read the key/value metadata section of a GGUF file, and nothing else.

`gguf.GGUFReader` parses the whole file (every tensor descriptor, memory-maps the data) and takes
seconds on a 100 MB model; the tokenizer only needs the metadata, which sits at the start of the
file. This module walks that section directly, following the GGUF specification
(ggml-org/ggml, docs/gguf.md): little-endian header `magic "GGUF", uint32 version, uint64
tensor_count, uint64 kv_count`, then `kv_count` entries of `string key, uint32 type, value`, where a
string is `uint64 length + UTF-8 bytes` and an array is `uint32 item type, uint64 count, items`.

Version 1 files (32-bit lengths) and big-endian files are refused with a ValueError.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from typing import Any

__all__ = ["read_gguf_metadata", "metadata_from_reader"]

_MAGIC = b"GGUF"

# GGUF value type codes -> struct format of a scalar of that type.
_SCALAR = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING = 8
_ARRAY = 9


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8 + n


def _read_value(cur: _Cursor, vtype: int, keep: bool) -> Any:
    if vtype == _STRING:
        if keep:
            return cur.string()
        cur.skip_string()
        return None
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype])
    if vtype == _ARRAY:
        itype = cur.unpack("<I")
        count = cur.unpack("<Q")
        if itype == _STRING:
            if not keep:
                for _ in range(count):
                    cur.skip_string()
                return count
            buf = cur.buf
            pos = cur.pos
            out = []
            append = out.append
            unpack_from = struct.unpack_from
            for _ in range(count):
                (n,) = unpack_from("<Q", buf, pos)
                pos += 8
                append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
                pos += n
            cur.pos = pos
            return out
        if itype in _SCALAR:
            fmt = _SCALAR[itype]
            size = struct.calcsize(fmt)
            if not keep:
                cur.pos += size * count
                return count
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
            cur.pos += size * count
            return values
        if itype == _ARRAY:
            # Nested arrays are legal but unused by tokenizers; read them generically.
            return [_read_value(cur, _ARRAY, keep) for _ in range(count)]
        raise ValueError(f"GGUF: unknown array item type {itype}")
    raise ValueError(f"GGUF: unknown value type {vtype}")


def read_gguf_metadata(path: str, full_arrays: Iterable[str] | None = None) -> dict[str, Any]:
    """Return the GGUF metadata of the file at `path` as `{key: value}`.

    Scalars come back as Python numbers/bools/str, arrays as lists. Arrays whose key is not in
    `full_arrays` are skipped and returned as their item count (saves time on large arrays such as
    `tokenizer.ggml.scores`); pass `full_arrays=None` to read every array in full.

    Raises ValueError when the file is not a little-endian GGUF of version 2 or later, and
    OSError when it cannot be opened.
    """
    wanted = None if full_arrays is None else set(full_arrays)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        cur = _Cursor(mm)
        cur.pos = 4
        version = cur.unpack("<I")
        if version < 2 or version > 0xFFFF:
            raise ValueError(f"{path}: unsupported GGUF version {version} (need >= 2, little-endian)")
        cur.unpack("<Q")  # tensor count
        kv_count = cur.unpack("<Q")
        out: dict[str, Any] = {"GGUF.version": version}
        for _ in range(kv_count):
            key = cur.string()
            vtype = cur.unpack("<I")
            keep = vtype != _ARRAY or wanted is None or key in wanted
            out[key] = _read_value(cur, vtype, keep)
        del cur
        return out


def metadata_from_reader(reader: Any, keys: Iterable[str]) -> dict[str, Any]:
    """Extract `keys` (those present) from an open `gguf.GGUFReader` as plain Python values.

    Strings decode as UTF-8, numeric arrays become lists of ints/floats, string arrays lists of str.
    """
    from gguf import GGUFValueType  # local: only needed when a reader is handed in

    out: dict[str, Any] = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is None:
            continue
        types = field.types
        if not types:
            continue
        if types[0] == GGUFValueType.ARRAY:
            item = types[-1]
            if item == GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            else:
                out[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif types[0] == GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        else:
            out[key] = field.parts[field.data[0]].tolist()[0]
    return out
