"""What a completion request's log line records for a trace of the traffic (`epdctl logs
--export-trace`, docs/traces.md): its prompt text's length in tokens (an estimate), its media
with their sizes, whether it streamed, and how many tokens it was answered with. Never its
content. Worked out once the answer is sent (Trace.line), off the client's path.

The text estimate counts words and punctuation marks, as `len(re.findall(r"\\w+|[^\\w\\s]",
text))` does for ASCII text (the proxy has no tokenizer, and gets none), in three passes of C
over the text's bytes instead of a regex match per token (20x cheaper). Bytes past ASCII count
as letters: a run of CJK is one word, so such prompts are underestimated.

Output tokens, the first of: the answer's `usage` (`completion_tokens`; `output_tokens` on the
Responses API), exact, in a whole answer or in a stream's last events (a stream has it where
the client asked for `stream_options.include_usage`, and always on /v1/responses); a stream's
events (counted as they are relayed, server/asgi.py: one bytes.count per chunk, nothing parsed)
less those before its first content (vLLM's role event, as the peek before the stream was
committed judged them) and `[DONE]`: one event per token in vLLM's streams, fewer than the
tokens where events carry several (`--stream-interval`, speculative decoding); else the
request's max_tokens (an upper bound). `out_from=` says which.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from epdctl.proxy.request import responses
from epdctl.proxy.request.parse import CHAT, COMPLETIONS, RESPONSES, MediaItem, find_media
from epdctl.proxy.request.sizes import measured
from epdctl.traces.format import MediaItem as Measured

_PUNCT = bytes(c for c in range(128) if not (chr(c).isalnum() or chr(c) == "_"
                                           or chr(c).isspace()))
_WORDS = bytes(ord("w") if c >= 128 or chr(c).isalnum() or chr(c) == "_" else ord(" ")
               for c in range(256))
"""Every byte as `w` (a word's: \\w, or past ASCII) or a space (space or punctuation)."""
_NUMBER = re.compile(rb"\s*:\s*(\d+)")
MAX_TOKEN_FIELDS = {CHAT: ("max_completion_tokens", "max_tokens"),
                    COMPLETIONS: ("max_tokens",), RESPONSES: ("max_output_tokens",)}


def text_tokens(text: str) -> int:
    """Words (runs of \\w) and punctuation marks in `text`: an estimate of its tokens."""
    data = text.encode("utf-8", "surrogatepass")
    words = data.translate(_WORDS)
    return (words.count(b" w") + words.startswith(b"w")
            + len(data) - len(data.translate(None, _PUNCT)))


def prompt_texts(route: str, body: dict[str, Any]) -> Iterator[str]:
    """The texts of a (checked) body's prompt: its messages', input's or prompt's."""
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        for piece in prompt if isinstance(prompt, list) else (prompt,):
            if isinstance(piece, str):
                yield piece
        return
    if route == RESPONSES and isinstance(body.get("instructions"), str):
        yield body["instructions"]
    items = body.get("messages" if route == CHAT else "input")
    if isinstance(items, str):
        yield items
        return
    for item in items if isinstance(items, list) else ():
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            yield content
            continue
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]


def prompt_tokens(route: str, body: dict[str, Any]) -> int:
    """The prompt's text tokens: estimated from its text, counted where it is token ids."""
    prompt = body.get("prompt") if route == COMPLETIONS else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        return sum(1 if isinstance(p, int) else len(p) if isinstance(p, list) else 0
                   for p in prompt)
    return text_tokens("\n".join(prompt_texts(route, body)))  # one pass: few, short texts


def usage_tokens(data: bytes, route: str) -> int | None:
    """The answer's output tokens from its last `usage` object, where `data` has one."""
    key = b'"output_tokens"' if route == RESPONSES else b'"completion_tokens"'
    at = data.rfind(key)
    while at > 0 and data[at - 1] == 0x5C:  # a backslash: the words inside a string
        at = data.rfind(key, 0, at)
    if at < 0:
        return None
    match = _NUMBER.match(data, at + len(key))
    return int(match[1]) if match else None


@dataclass(eq=False)
class Recorded:
    """What the line of one completion request records for a trace."""

    route: str
    body: dict[str, Any]
    is_stream: bool
    items: list[MediaItem] | None = None
    """The media stage's items (a fetched URL's bytes with them); else found in the body."""
    answer: bytes = b""
    """A whole answer's body (its usage)."""
    events: int = 0
    """A stream's events, as relayed (server/asgi.py)."""
    waits: int | None = None
    """Those before its first content, as the peek judged them (stages/generate.py)."""
    tail: bytes = b""
    """A stream's last two chunks."""

    def fields(self) -> list[str]:
        """`text_tokens=N media=image:640x480,... out_tokens=N out_from=... stream=1`."""
        parts = [f"text_tokens={prompt_tokens(self.route, self.body)}"]
        media = self.media()
        if media:
            parts.append("media=" + ",".join(m.label for m in media))
        out, source = self.output()
        if out is not None:
            parts += [f"out_tokens={out}", f"out_from={source}"]
        if self.is_stream:
            parts.append("stream=1")
        return parts

    def media(self) -> list[Measured]:
        """Each media item's type and size."""
        items = self.items
        if items is None:
            items = find_media(self.body) if self.route == CHAT else \
                responses.find_media(self.body) if self.route == RESPONSES else []
        return [measured(it.modality, it.data_url or it.ref,
                         is_base64=it.part_type == "input_audio" and it.data_url is None)
                for it in items]

    def output(self) -> tuple[int | None, str]:
        """Output tokens and where they come from: usage, events or max_tokens."""
        used = usage_tokens(self.tail if self.is_stream else self.answer, self.route)
        if used is not None:
            return used, "usage"
        if self.is_stream and self.events:
            done = 1 if b"[DONE]" in self.tail else 0
            return max(self.events - (self.waits or 0) - done, 0), "events"
        for key in MAX_TOKEN_FIELDS.get(self.route, ()):
            value = self.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, "max_tokens"
        return None, ""
