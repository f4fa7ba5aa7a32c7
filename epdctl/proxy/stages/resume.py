"""What a broken stream already gave the client, and the request that goes on from there:
the text so far as an assistant prefix (chat) or after the prompt (completions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.errors import ENGINE_DEAD
from epdctl.proxy.request.parse import CHAT, COMPLETIONS
from epdctl.proxy.sse import EVENT_END, event_data

_PENALTIES = ("presence_penalty", "frequency_penalty")
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")


@dataclass
class SoFar:
    """The client's stream up to the break."""

    text: str = ""
    tokens: int = 0
    """Content chunks sent: one per token unless vLLM merged some (a reader that lags)."""
    is_finished: bool = False
    """A finish_reason was sent: only the usage chunk and [DONE] may be missing."""
    is_done: bool = False
    last: dict[str, Any] = field(default_factory=dict)
    """The last chunk sent (its id, object, model and created start a made-up one)."""
    why_not: str | None = None
    """Why the stream cannot go on exactly, if it cannot."""


def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """Complete events, and what is left of one not yet complete (all of `buf` when no
    event in it is complete)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    return buf[:end], buf[end:]


def events(buf: bytes) -> list[Any]:
    """Every complete event's data, decoded: "[DONE]", a JSON value, or None (a comment)."""
    out: list[Any] = []
    for event in EVENT_END.split(buf)[:-1]:
        data = event_data(event)
        if data is None:
            out.append(None)
        elif data.strip() == b"[DONE]":
            out.append("[DONE]")
        else:
            try:
                out.append(jsonio.loads(data))
            except ValueError:
                out.append(None)
    return out


def is_dead_engine(buf: bytes) -> bool:
    """Whether an error in `buf` is vLLM's own for its dead engine (cheap: bytes first)."""
    return ENGINE_DEAD in buf and any(
        isinstance(e, dict) and "error" in e and "choices" not in e for e in events(buf))


def dead_engine_at(buf: bytes) -> int | None:
    """Where in `buf` (whole events) vLLM's own event for its dead engine begins, if one is
    there: what comes before it reached the client's stream, the rest never does."""
    if ENGINE_DEAD not in buf:
        return None
    start = 0
    for end in EVENT_END.finditer(buf):
        if is_dead_engine(buf[start:end.end()]):
            return start
        start = end.end()
    return None


def read_so_far(sent: bytes, route: str) -> SoFar:
    """What the client has, from the bytes it was sent."""
    so_far = SoFar()
    pieces: list[str] = []
    for event in events(sent):
        if event == "[DONE]":
            so_far.is_done = True
            continue
        if not isinstance(event, dict):
            continue
        so_far.last = event
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                so_far.why_not = "several choices (n>1)"
            if choice.get("logprobs"):
                so_far.why_not = "logprobs would differ"
            delta = choice.get("delta") if route == CHAT else choice
            if not isinstance(delta, dict):
                continue
            if delta.get("tool_calls") or delta.get("function_call"):
                so_far.why_not = "a tool call was half sent"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                so_far.why_not = "reasoning cannot be continued"
            piece = delta.get("content") if route == CHAT else delta.get("text")
            if isinstance(piece, str) and "role" not in delta:
                pieces.append(piece)
                so_far.tokens += 1
            if choice.get("finish_reason") is not None:
                so_far.is_finished = True
    so_far.text = "".join(pieces)
    return so_far


def why_not(body: dict[str, Any], route: str) -> str | None:
    """Why a request's stream cannot be continued exactly, or None when it can."""
    if route not in (CHAT, COMPLETIONS):
        return f"{route} streams are not resumed"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "several choices (n>1)"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs would differ"
    if any(body.get(k) for k in _PENALTIES):
        return "presence/frequency penalties count only the tokens generated"
    form = body.get("response_format")
    if any(body.get(k) for k in _STRUCTURED) or (
            isinstance(form, dict) and form.get("type") not in (None, "text")):
        return "structured output restarts at the prefix"
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "a forced tool call"
    if route == COMPLETIONS:
        if body.get("echo") or body.get("suffix"):
            return "echo/suffix"
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and len(prompt) == 1
                                                and isinstance(prompt[0], str)):
            return "a prompt of token ids, or several prompts"
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages"
    last = messages[-1]
    if body.get("continue_final_message") and not (
            isinstance(last, dict) and isinstance(last.get("content"), str)):
        return "a final message to continue that is not text"
    return None


def continuation(body: dict[str, Any], route: str, text: str, sent_tokens: int
                 ) -> dict[str, Any] | None:
    """The request that generates the rest: the text so far after the prompt, the limits
    less what was sent; None when the limit is already reached."""
    new = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            new[key] = body[key] - sent_tokens
            if new[key] <= 0:
                return None
    if isinstance(body.get("min_tokens"), int):
        new["min_tokens"] = max(0, body["min_tokens"] - sent_tokens)
    if not text:
        return new
    if route == COMPLETIONS:
        prompt = body["prompt"]
        new["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
        return new
    messages = list(body["messages"])
    last = messages[-1]
    if body.get("continue_final_message") and isinstance(last, dict) \
            and last.get("role") == "assistant":
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    new.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return new


def length_finish(so_far: SoFar, route: str) -> bytes:
    """The chunk vLLM would have sent at the token limit, after the last one sent."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if route == CHAT:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    keys = ("id", "object", "created", "model")
    chunk = {**{k: so_far.last[k] for k in keys if k in so_far.last}, "choices": [choice]}
    return sse_data(chunk)


def sse_data(obj: Any) -> bytes:
    return b"data: " + jsonio.dumps(obj) + b"\n\n"


def adjust(chunk: bytes, sent_tokens: int, state: dict[str, bool]) -> bytes:
    """One continuation chunk (complete events) as the client's stream goes on: without
    the opening role chunk (it had one), usage counted as if nothing had broken."""
    if state.get("is_started") and b'"usage"' not in chunk:
        return chunk
    out = []
    for raw in EVENT_END.split(chunk)[:-1]:
        event = events(raw + b"\n\n")[0]
        if not state.get("is_started"):
            if isinstance(event, dict) and _is_opening(event):
                continue
            state["is_started"] = True
        usage = event.get("usage") if isinstance(event, dict) else None
        if isinstance(usage, dict) and sent_tokens:
            usage = {**usage, "prompt_tokens": usage.get("prompt_tokens", 0) - sent_tokens,
                     "completion_tokens": usage.get("completion_tokens", 0) + sent_tokens}
            out.append(sse_data({**event, "usage": usage}))
            continue
        out.append(raw + b"\n\n")
    return b"".join(out)


def _is_opening(event: dict[str, Any]) -> bool:
    """vLLM's first chat chunk: a role and no content, nor finish (a completion stream has
    none); with continuous usage stats it carries a usage too."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta or delta.get("content") \
                or delta.get("tool_calls"):
            return False
    return True


class Diverged(Exception):
    """The answer generated again is not the one the client was already sent."""


class Skip:
    """A stream generated again from the start, less the text the client already has
    (checked as it goes): when the text so far would not tokenize back into the tokens
    that were generated, only the same request, whole, gives the same answer."""

    def __init__(self, text: str, route: str) -> None:
        self.text = text
        self.left = text
        self.key = "content" if route == CHAT else "text"

    def __call__(self, chunk: bytes) -> bytes:
        if not self.left:
            return chunk
        out = []
        for raw in EVENT_END.split(chunk)[:-1]:
            event = events(raw + b"\n\n")[0]
            choices = event.get("choices") if isinstance(event, dict) else None
            if not self.left or not choices or not isinstance(choices[0], dict):
                out.append(raw + b"\n\n")
                continue
            choice = choices[0]
            delta = choice.get("delta", {}) if self.key == "content" else choice
            piece = delta.get(self.key) if isinstance(delta, dict) else None
            if not isinstance(piece, str) or "role" in delta:
                if choice.get("finish_reason") is not None:
                    raise Diverged("it ended sooner")
                continue  # the opening chunk: the client had one
            n = min(len(piece), len(self.left))
            if piece[:n] != self.left[:n]:
                at = len(self.text) - len(self.left)
                before = self.text[max(at - 24, 0):at]
                raise Diverged(f"{piece[:n]!r} where {self.left[:n]!r} was sent, at character "
                               f"{at} of {len(self.text)} (after {before!r})")
            self.left = self.left[n:]
            if n == len(piece) and choice.get("finish_reason") is None:
                continue
            delta = {**delta, self.key: piece[n:]}
            choice = {**choice, "delta": delta} if self.key == "content" else delta
            out.append(sse_data({**event, "choices": [choice, *choices[1:]]}))
        return b"".join(out)
