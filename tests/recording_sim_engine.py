"""The simulated engine (`python -m epdctl.sim.engine`) that also appends one JSON line per
chat request it gets to RECORD: its role, its media (kind and size), its prompt's words,
max_tokens and whether it streams; the shapes a replayed trace put on the wire.

    python tests/recording_sim_engine.py RECORD <the engine's arguments>
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
from typing import Any

from epdctl.sim import engine
from epdctl.sim.options import parse_options


def _b64(data: str) -> bytes:
    return base64.b64decode(data.partition(",")[2] if data.startswith("data:") else data)


def _media(part: dict[str, Any]) -> dict[str, Any] | None:
    kind = part.get("type")
    if kind == "image_url":
        raw = _b64(part["image_url"]["url"])
        width, height = struct.unpack(">II", raw[16:24])
        return {"type": "image", "width": width, "height": height}
    if kind == "video_url":
        frames = part["video_url"]["url"].partition(",")[2].split(",")
        width, height = struct.unpack(">II", base64.b64decode(frames[0])[16:24])
        return {"type": "video", "width": width, "height": height, "frames": len(frames)}
    if kind == "input_audio":
        raw = _b64(part["input_audio"]["data"])
        rate, = struct.unpack("<I", raw[24:28])
        return {"type": "audio", "seconds": (len(raw) - 44) / 2 / rate}
    return None


def shape(body: dict[str, Any]) -> dict[str, Any]:
    media, words = [], 0
    for message in body.get("messages") or []:
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts or []:
            if part.get("type") == "text":
                words += len(part["text"].split())
            elif (item := _media(part)) is not None:
                media.append(item)
    return {"media": media, "words": words, "max_tokens": body.get("max_tokens"),
            "stream": bool(body.get("stream")), "salted": "cache_salt" in body}


def main() -> None:
    record, argv = sys.argv[1], sys.argv[2:]
    role = parse_options(argv).role
    parse_work = engine.parse_work

    def recorded(body: dict[str, Any], chat: bool, facts: Any) -> Any:
        line = json.dumps({"role": role, **shape(body)}) + "\n"
        # One O_APPEND write per line: lines from several engines never mix.
        fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return parse_work(body, chat, facts)

    engine.parse_work = recorded  # type: ignore[assignment]
    engine.main(argv)


if __name__ == "__main__":
    main()
