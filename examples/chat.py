"""Send an image + text request to an epdctl proxy with the official `openai` client.

    python examples/chat.py                                  # a generated test image
    python examples/chat.py --image photo.jpg --prompt "What is in this picture?"
    python examples/chat.py --image https://example.com/cat.png --no-stream

Prints the answer twice: once streamed, once not (unless --stream/--no-stream picks one).
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import struct
import sys
import zlib
from pathlib import Path

from openai import OpenAI


def test_png(seed: int = 0, size: int = 56) -> bytes:
    """A small, deterministic RGB gradient PNG (stdlib only), different for each seed."""
    rows = []
    for y in range(size):
        row = bytearray([0])  # filter type 0 for each scanline
        for x in range(size):
            red, green = (x * 7 + seed * 53) % 256, (y * 5 + seed * 31) % 256
            row += bytes((red, green, (x * y + seed) % 256))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def image_url(image: str | None, seed: int) -> str:
    """A URL the server accepts: http(s) as given, a local file or a generated PNG as data URL."""
    if image and image.startswith(("http://", "https://", "data:")):
        return image
    if image:
        mime = mimetypes.guess_type(image)[0] or "image/png"
        data = Path(image).read_bytes()
    else:
        mime, data = "image/png", test_png(seed)
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--image", help="file, http(s) URL or data URL; default: a test image")
    parser.add_argument("--seed", type=int, default=0, help="which generated test image")
    parser.add_argument("--prompt", default="Describe this image.")
    parser.add_argument("--max-tokens", type=int, default=32)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="mode", action="store_const", const="stream")
    mode.add_argument("--no-stream", dest="mode", action="store_const", const="plain")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=120)
    model = args.model or client.models.list().data[0].id
    messages = [{
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_url(args.image, args.seed)}},
            {"type": "text", "text": args.prompt},
        ],
    }]
    common = {"model": model, "messages": messages, "max_tokens": args.max_tokens,
              "temperature": 0.0}
    if args.mode in (None, "plain"):
        reply = client.chat.completions.create(**common)
        print(f"answer: {reply.choices[0].message.content}")
    if args.mode in (None, "stream"):
        print("streamed: ", end="", flush=True)
        for chunk in client.chat.completions.create(**common, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
