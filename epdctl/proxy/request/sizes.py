"""A media item's size read from the first bytes of its data, for the request log's trace
fields: an image's width x height from its header (PNG, JPEG, GIF, WebP, BMP), a `video/jpeg`
frame list's frame count and first frame's size, a WAV clip's seconds. Stdlib only: no image
library is loaded, and only the header's base64 is decoded, never the whole item."""

from __future__ import annotations

import binascii
import struct

from epdctl.traces.format import MediaItem

FIRST_CHARS = 64
"""base64 decoded first (48 bytes): a PNG's, GIF's, WebP's, BMP's or plain WAV's header."""
HEAD_CHARS = 4096
"""Then, for a JPEG (3 KiB): its frame header behind a little metadata."""
MAX_HEAD_CHARS = 1 << 18
"""At most, for a JPEG (192 KiB): behind EXIF and ICC segments."""
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""Start-of-frame markers (C4 Huffman tables, C8 reserved, CC arithmetic coding are not)."""


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from an image's first bytes, or None (another format, or too few)."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            return _positive(struct.unpack(">II", data[16:24]))
        if data.startswith(b"\xff\xd8"):
            return _jpeg(data)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return _positive(struct.unpack("<HH", data[6:10]))
        if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
            return _webp(data)
        if data.startswith(b"BM") and len(data) >= 26:
            width, height = struct.unpack("<ii", data[18:26])
            return _positive((width, abs(height)))  # negative: rows stored top-down
    except struct.error:  # fewer bytes than the header
        return None
    return None


def _positive(size: tuple[int, int]) -> tuple[int, int] | None:
    return size if size[0] > 0 and size[1] > 0 else None


def _jpeg(data: bytes) -> tuple[int, int] | None:
    """Walk the segments to the first start-of-frame: its height and width."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length follows
            at += 2
            continue
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return _positive((width, height))
        if marker == 0xD9 or marker == 0xDA:  # end of image, or scan data before any frame
            return None
        at += 2 + struct.unpack(">H", data[at + 2:at + 4])[0]
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    kind = data[12:16]
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return _positive((width & 0x3FFF, height & 0x3FFF))
    if kind == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":
        return (int.from_bytes(data[24:27], "little") + 1,
                int.from_bytes(data[27:30], "little") + 1)
    return None


def wav_seconds(data: bytes, total_bytes: int | None = None) -> float | None:
    """A WAV clip's length from its header: the data chunk's bytes over the byte rate (where
    a streaming writer left the data size open, the file's `total_bytes` stand for it)."""
    if not (data.startswith(b"RIFF") and data[8:12] == b"WAVE"):
        return None
    at, byte_rate = 12, 0
    while at + 8 <= len(data):
        kind = data[at:at + 4]
        size = int.from_bytes(data[at + 4:at + 8], "little")
        if kind == b"fmt " and at + 16 <= len(data):
            byte_rate = int.from_bytes(data[at + 16:at + 20], "little")
        elif kind == b"data":
            if size in (0, 0xFFFFFFFF) and total_bytes is not None:
                size = total_bytes - at - 8
            return round(size / byte_rate, 3) if byte_rate and size > 0 else None
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return None


def b64_head(text: str, start: int = 0, chars: int = HEAD_CHARS) -> bytes:
    """The first bytes of the base64 text[start:] up to a comma (the next `video/jpeg` frame)
    or `chars` characters, a whole number of 4-character groups of them (no copy of the
    rest); b"" where it is not base64."""
    end = text.find(",", start, start + chars)
    piece = text[start:end if end >= 0 else start + chars]
    piece = piece[:len(piece) - len(piece) % 4]
    try:
        return binascii.a2b_base64(piece)
    except (binascii.Error, ValueError):
        return b""


def _b64_bytes(text: str, start: int) -> int:
    """How many bytes the base64 text[start:] decodes to (unwrapped base64)."""
    chars = len(text) - start
    return chars // 4 * 3 - text.endswith("=") - text.endswith("==")


def measured(modality: str, ref: str, *, is_base64: bool = False) -> MediaItem:
    """The item's type and what its data tells of its size (a data URL, or `input_audio`'s
    base64 with `is_base64`); the type alone for a URL (the proxy fetched none) or a format
    whose header is not read here (an MP4's frames, an MP3's seconds)."""
    if is_base64:
        start = 0
    elif ref.startswith("data:") and (comma := ref.find(",", 0, 256)) > 0 \
            and ref[:comma].endswith(";base64"):
        start = comma + 1
    else:
        return MediaItem(modality)
    head = b64_head(ref, start, FIRST_CHARS)
    if modality == "audio":
        seconds = wav_seconds(head, _b64_bytes(ref, start))
        if seconds is None and head.startswith(b"RIFF"):  # chunks before the data's
            seconds = wav_seconds(b64_head(ref, start), _b64_bytes(ref, start))
        return MediaItem("audio", seconds=seconds)
    frames = None
    if modality == "video":
        if is_base64 or ref[5:start - 1].lower() != "video/jpeg;base64":
            return MediaItem("video")
        frames = ref.count(",", start) + 1  # vLLM's form: base64 JPEG frames, comma-joined
    size, decoded = image_size(head), FIRST_CHARS
    for chars in (HEAD_CHARS, MAX_HEAD_CHARS):  # a JPEG's frame header behind its metadata
        if size is not None or not head.startswith(b"\xff\xd8") or len(ref) - start <= decoded:
            break
        size, decoded = image_size(b64_head(ref, start, chars)), chars
    width, height = size or (None, None)
    return MediaItem(modality, width, height, frames)
