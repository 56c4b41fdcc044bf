"""The swap file format: file names, the header (layout, encode, check), and the file states.

[Note: swap file layout] A swap file is ``header_bytes`` (the alignment rounded up to 4096) of header,
then the payload padded to the alignment. The header holds magic, format version, generation, dtype,
shape, payload bytes and a CRC32 of itself. A swap-out invalidates first and validates last: it
zeroes the header, writes the payload, and writes the new header only when every payload write
succeeded; on any error the file is deleted and the key is marked failed. A swap-in checks the header
against what the swapper recorded for the key (generation, dtype, shape), so a stale, half-written,
truncated or foreign file is an error, never silently read. Files are rewritten in place rather than
renamed from a temp file because reusing allocated blocks writes ~1.6x faster on ext4 here.

The I/O that follows this layout lives in :class:`infinity.io.Swapper`.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import zlib
from urllib.parse import quote

import torch

from infinity._dtypes import torch_name
from infinity._transitions import TransitionTable
from infinity.errors import SwapIOError

MAGIC = b"INFSWAP\x01"
FORMAT_VERSION = 1
"""Bumped on any change a reader of the previous version would misread."""
# magic, version, header_bytes, generation, payload_bytes, numel, dtype name, ndim; shape follows.
HEADER_FIXED = struct.Struct("<8sIIQQQ16sI")
HEADER_CRC = struct.Struct("<I")
MAX_NDIM = 64
MAX_KEY_CHARS = 1024


class FileState(enum.Enum):
    """State of one key's swap file. Bytes live on NVMe in VALID only.

    WRITING: a temp file is being written; no valid file for this key exists on disk.
    VALID: ``<name>.swp`` holds the recorded generation, dtype and shape.
    FAILED: the last swap-out failed; no file exists; swap-in raises until the key is written again.
    REMOVED: ``remove(key)`` ran; the record is dropped.
    """

    WRITING = "writing"
    VALID = "valid"
    FAILED = "failed"
    REMOVED = "removed"


_W, _V, _F, _X = FileState.WRITING, FileState.VALID, FileState.FAILED, FileState.REMOVED
TRANSITIONS = TransitionTable("swap file", {
    (_W, _F): "a write failed (short write, ENOSPC, an I/O error): the file is deleted, and "
              "swap-ins of the key raise until it is written again",
    (_W, _V): "every payload write succeeded and the new header is written",
    (_V, _W): "a new swap-out of the key starts (the header is invalidated first)",
    (_F, _W): "the key is written again after a failure, under a new generation (a header from "
              "an earlier write can never pass for it)",
    (_V, _X): "remove(key): the file is deleted",
    (_F, _X): "remove(key) of a key whose last write failed",
})
"""The allowed FileState transitions, each with why; checked in one place, ``_KeyRecord.transition``."""


# ------------------------------------------------------------------------------------------------
# Header


def encode_header(*, header_bytes: int, generation: int, tensor: torch.Tensor) -> bytes:
    """The header describing ``tensor``'s bytes written as ``generation`` (before zero padding)."""
    shape = tuple(tensor.shape)
    nbytes = tensor.numel() * tensor.element_size()
    fixed = HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, header_bytes, generation, nbytes,
                              tensor.numel(), torch_name(tensor.dtype).encode(), len(shape))
    body = fixed + struct.pack(f"<{len(shape)}q", *shape)
    return body + HEADER_CRC.pack(zlib.crc32(body))


def check_header(raw: bytes, *, key: str, path: str, generation: int,
                 tensor: torch.Tensor) -> None:
    """Raise SwapIOError unless ``raw`` describes exactly ``tensor``'s bytes written as
    ``generation`` under ``key``."""
    nbytes = tensor.numel() * tensor.element_size()

    def bad(what: str) -> SwapIOError:
        return SwapIOError(f"swap file for key {key!r} is not valid: {what}; it was "
                           "modified outside the swapper or written by another run; swap the key "
                           "out again", path=path, offset=0, expected_bytes=nbytes)

    magic, version, _, found_gen, payload, numel, dtype, ndim = HEADER_FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise bad(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise bad(f"format version {version}, expected {FORMAT_VERSION}")
    if ndim > MAX_NDIM:
        raise bad(f"ndim {ndim}")
    end = HEADER_FIXED.size + 8 * ndim
    (crc,) = HEADER_CRC.unpack_from(raw, end)
    if crc != zlib.crc32(raw[:end]):
        raise bad("header checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}q", raw, HEADER_FIXED.size)
    found = (found_gen, payload, numel, dtype.rstrip(b"\0").decode(), tuple(shape))
    want = (generation, nbytes, tensor.numel(), torch_name(tensor.dtype), tuple(tensor.shape))
    if found != want:
        raise bad(f"header (generation, bytes, numel, dtype, shape) = {found}, expected {want}")


# ------------------------------------------------------------------------------------------------
# File names


def validate_key(key: str) -> None:
    """Raise ValueError unless ``key`` names a file inside the swap directory."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"swap key must be a non-empty string, got {key!r}")
    if "\0" in key or len(key) > MAX_KEY_CHARS:
        raise ValueError(f"swap key {key[:80]!r} contains NUL or is longer than {MAX_KEY_CHARS}")
    if key.startswith(("/", "\\")) or os.path.isabs(key) or ".." in key.replace("\\", "/").split("/"):
        raise ValueError(f"swap key {key!r} would escape the swap directory (absolute path or '..');"
                         " use plain names such as 'layer.3/weight'")


def key_filename(key: str) -> str:
    """The file name (without ``.swp``) of a validated ``key``: flat, distinct, under 255 bytes."""
    name = quote(key, safe="._-")  # '/' and everything odd become %XX: one flat directory
    if len(name) > 180:  # file names stop at 255 bytes; a strong hash keeps long keys distinct
        name = name[:100] + "~" + hashlib.sha256(key.encode()).hexdigest()
    return name
