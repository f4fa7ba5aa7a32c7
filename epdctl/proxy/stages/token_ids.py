"""The ids of the tokens a stream generated, so that a broken stream goes on after exactly
those tokens: vLLM's `return_token_ids` asked of every resumable stream, and taken out of
the chunks again when the client did not ask for it (they then read as vLLM sends them
without it: `"token_ids":null`, and no chunk that carries ids only).

The text a client was sent is not enough: a text can tokenize back into as many tokens as
were generated, but other ones ("ab"+"c" generated, "a"+"bc" tokenized), and a prefix of
other tokens changes what follows."""

from __future__ import annotations

import re
from typing import Any

from epdctl.proxy.request.parse import CHAT
from epdctl.proxy.sse import EVENT_END
from epdctl.proxy.stages.resume import events

KEY = "return_token_ids"
_IDS = re.compile(rb'"(prompt_)?token_ids":\s*\[([0-9,\s]*)\]')
_IDS_ONLY = re.compile(rb'"delta":\s*\{\}')


def asking(as_dict: dict[str, Any]) -> dict[str, Any]:
    """`as_dict` asking for token ids."""
    return {**as_dict, KEY: True}


def asked(body: dict[str, Any] | bytes, as_dict: dict[str, Any]
          ) -> tuple[dict[str, Any] | bytes, bool]:
    """`body` (which says `as_dict`) asking for token ids, and whether that is the proxy's
    doing (not the client's). A body as bytes stays bytes: the key goes in front."""
    if as_dict.get(KEY):
        return body, False
    if isinstance(body, dict) or KEY in as_dict:  # the client said false: made true
        return asking(as_dict), True
    start = body.find(b"{")
    if start < 0:
        return body, False
    rest = body[start + 1:]
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return body[:start + 1] + b'"' + KEY.encode() + b'":true' + comma + rest, True


class TokenIds:
    """Reads a stream's chunks (whole events) as they pass: the ids of the tokens generated
    so far, in order (the prompt's are not kept)."""

    def __init__(self, route: str, is_ours: bool) -> None:
        self.route = route
        self.is_ours = is_ours
        self.ids: list[int] = []
        self.is_seen = False
        """The instance sent ids: without them, nothing is known of the tokens."""

    def restart(self) -> None:
        """The answer is generated again from its start: its ids come again."""
        self.ids = []

    def __call__(self, chunk: bytes) -> bytes:
        if b'token_ids"' not in chunk:
            return chunk

        def take(match: re.Match[bytes]) -> bytes:
            if not match.group(1):
                self.is_seen = True
                self.ids.extend(int(i) for i in match.group(2).split(b",") if i.strip())
            return b'"' + (match.group(1) or b"") + b'token_ids":null' if self.is_ours \
                else match.group(0)

        out = _IDS.sub(take, chunk)
        if self.is_ours and self.route == CHAT and _IDS_ONLY.search(out):
            out = b"".join(raw + b"\n\n" for raw in EVENT_END.split(out)[:-1]
                           if not _is_ids_only(raw))
        return out


def _is_ids_only(raw: bytes) -> bool:
    """A chat chunk vLLM sends only because ids were asked for (no text yet: a token held
    back), which it skips otherwise."""
    if not _IDS_ONLY.search(raw):
        return False
    event = events(raw + b"\n\n")[0]
    if not isinstance(event, dict) or event.get("usage"):
        return False
    choices = event.get("choices")
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None
        and not c.get("logprobs") for c in choices)
