"""Entry file format and file-name rules of the EC store (stdlib only)."""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from dataclasses import dataclass

from epdctl.cache import FORMAT_VERSION

MAGIC = b"EPDCTLEC"
_PREFIX = struct.Struct("<8sII")  # magic, format version, length of the meta that follows
# Meta: nbytes, created_ns, ndim, then the byte lengths of key, namespace and dtype; then
# the shape (ndim x u64) and the three UTF-8 strings. Binary: a header is encoded and
# decoded on every save and load, and JSON costs several times more.
_META = struct.Struct("<QQHHHH")
# Data starts page-aligned so reads and mmaps of the payload are aligned too.
PAGE_BYTES = 4096
ENTRY_SUFFIX = ".ec"

_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_SAFE_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MAX_KEY_CHARS = 100
_MAX_PART_CHARS = 48

# Bytes per element of the dtypes an encoder can produce; names are torch's.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


class FormatError(ValueError):
    """An entry's bytes are not a valid entry (truncated, foreign, corrupt)."""


# Cached: names are made on every save, pin and load, and regex and sha256 cost more.
@functools.lru_cache(maxsize=4096)
def _safe_name(text: str, max_chars: int) -> str:
    """`text` if it is a short, plain file name; else `~` + a hash of it."""
    if len(text) <= max_chars and _SAFE.fullmatch(text):
        return text
    # '~' is outside the safe alphabet, so a hashed name never equals a plain one.
    return "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def key_filename(key: str) -> str:
    """The file name stem of `key` (mm_hash may hold ':' or be chosen by a client)."""
    if len(key) <= _MAX_KEY_CHARS and _SAFE.fullmatch(key):
        # A plain key (content and client keys are) is its own name: no trip through the
        # cache, which every fresh key would churn (the proxy makes one per image).
        return key
    return _safe_name(key, _MAX_KEY_CHARS)


def namespace_dirname(namespace: str) -> str:
    """The directory name of a namespace: itself when it is a plain name."""
    if len(namespace) <= 200 and _SAFE_DIR.fullmatch(namespace):
        return namespace
    return _safe_name(namespace, 0)


def name_part(text: str) -> str:
    """A pin-name component (engine or request id), short and free of dots."""
    return _safe_name(text, _MAX_PART_CHARS)


@dataclass(frozen=True)
class EntryHeader:
    """What an entry file says about its payload."""

    key: str
    namespace: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    created_ns: int
    data_offset: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0


def payload_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a C-contiguous array; FormatError for an unknown dtype."""
    try:
        size = DTYPE_BYTES[dtype]
    except KeyError:
        raise FormatError(f"unknown dtype {dtype!r}") from None
    for dim in shape:
        size *= dim
    return size


def encode_header(
    key: str, namespace: str, dtype: str, shape: tuple[int, ...], created_ns: int
) -> bytes:
    """The header bytes, padded so the payload starts on a page boundary."""
    nbytes = payload_nbytes(dtype, shape)
    texts = [t.encode("utf-8", "surrogatepass") for t in (key, namespace, dtype)]
    meta = b"".join(
        [
            _META.pack(nbytes, created_ns, len(shape), *(len(t) for t in texts)),
            struct.pack(f"<{len(shape)}Q", *shape),
            *texts,
        ]
    )
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(meta)) + meta
    padded = -(-len(head) // PAGE_BYTES) * PAGE_BYTES
    return head + bytes(padded - len(head))


def decode_header(buf: bytes) -> EntryHeader:
    """Parse the header at the start of `buf`; FormatError if it is not ours."""
    if len(buf) < _PREFIX.size:
        raise FormatError("truncated header")
    magic, version, length = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise FormatError("bad magic")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, expected {FORMAT_VERSION}")
    end = _PREFIX.size + length
    if end > len(buf) or length < _META.size:
        raise FormatError("truncated header")
    try:
        nbytes, created_ns, ndim, *lengths = _META.unpack_from(buf, _PREFIX.size)
        pos = _PREFIX.size + _META.size
        shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
        pos += 8 * ndim
        texts = []
        for n in lengths:
            texts.append(bytes(buf[pos : pos + n]).decode("utf-8", "surrogatepass"))
            pos += n
    except (struct.error, UnicodeDecodeError) as exc:
        raise FormatError(f"corrupt header: {exc}") from None
    if pos != end:
        raise FormatError("corrupt header: its lengths do not add up")
    key, namespace, dtype = texts
    if dtype not in DTYPE_BYTES or nbytes != payload_nbytes(dtype, shape):
        raise FormatError("header nbytes does not match dtype and shape")
    return EntryHeader(
        key=key,
        namespace=namespace,
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        created_ns=created_ns,
        data_offset=-(-end // PAGE_BYTES) * PAGE_BYTES,
    )
