"""Generated images (stdlib): the PNGs that bench's generated datasets, tune's probes, the
trace replayer and the simulated machine's load generator send."""

from __future__ import annotations

import random
import struct
import zlib


def png(width: int, height: int, seed: int, tag: bytes = b"") -> bytes:
    """A deterministic RGB PNG; every seed gives other bytes (stdlib, fast enough for 1k^2).
    `tag` overwrites the first pixels' bytes: distinct tags give distinct pixels, where
    seeds alone draw one of 2**24 colourings (vLLM hashes pixels, not bytes)."""
    rng = random.Random(seed)
    offsets = [rng.randrange(256) for _ in range(3)]
    row = bytes(((x * 7 + offsets[0]) % 256, (x * 3 + offsets[1]) % 256, offsets[2])[c]
                for x in range(width) for c in range(3))
    rows = bytearray()
    for y in range(height):
        table = bytes((i + y * 5) % 256 for i in range(256))
        line = row.translate(table)
        rows += b"\x00" + (tag + line[len(tag):] if y == 0 and tag else line)[:len(line)]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(rows), 1)) + chunk(b"IEND", b""))
