"""The proxy as a drop-in for `vllm serve`, on real vLLM: the same requests straight to the
topology's final instance (pd-0, or decode-0) and through the proxy get the same status,
body shape and (temperature 0) outputs. Used by test_cpu_demo.py and test_cpu_epd.py on
their running topologies (no topology of its own)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.harness import TopologyRun, cache_entry, image_data_url, make_image, wait_for

MODEL = "tiny-llava"
IMAGE = image_data_url(make_image(61))
JUNK = "data:image/png;base64,bm90IGFuIGltYWdlIGF0IGFsbA=="  # valid base64, not an image
# Ids vLLM draws at random for output items and cards; timestamps differ by a second.
_RANDOM_ID = re.compile(r"^((?:msg|rs|fc|ctc)_|modelperm-)[0-9a-f]+$")
_TIMES = frozenset({"created", "created_at"})
_IDS = frozenset({"id", "item_id"})


def chat(content: Any = "Say something.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 8, **extra}


def image_chat(url: str = IMAGE, **extra: Any) -> dict[str, Any]:
    return chat([{"type": "image_url", "image_url": {"url": url}},
                 {"type": "text", "text": "What is in the image?"}], **extra)


def responses(content: Any = "Say something.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": content}],
            "temperature": 0, "max_output_tokens": 8, "store": False, **extra}


def image_responses(url: str = IMAGE, **extra: Any) -> dict[str, Any]:
    return responses([{"type": "input_image", "image_url": url},
                      {"type": "input_text", "text": "What is in the image?"}], **extra)


def requests(missing_url: str) -> list[tuple[str, str, str, Any]]:
    """(name, method, path, JSON body or raw bytes): what both sides are sent."""
    completion = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0,
                  "max_tokens": 8}
    return [
        ("chat", "POST", "/v1/chat/completions", chat()),
        ("chat-stream", "POST", "/v1/chat/completions",
         chat(stream=True, stream_options={"include_usage": True})),
        ("chat-image", "POST", "/v1/chat/completions", image_chat()),
        ("chat-image-stream", "POST", "/v1/chat/completions", image_chat(stream=True)),
        ("chat-stream-yes", "POST", "/v1/chat/completions", chat(stream="yes")),
        ("completions", "POST", "/v1/completions", completion),
        ("completions-stream", "POST", "/v1/completions", {**completion, "stream": True}),
        ("responses", "POST", "/v1/responses", responses(request_id="resp_parity1")),
        ("responses-stream", "POST", "/v1/responses",
         responses(stream=True, request_id="resp_parity2")),
        ("responses-image", "POST", "/v1/responses", image_responses(request_id="resp_p3")),
        ("responses-image-stream", "POST", "/v1/responses",
         image_responses(stream=True, request_id="resp_p4")),
        ("responses-input-file", "POST", "/v1/responses", responses(
            [{"type": "input_file", "file_data": IMAGE, "filename": "x.png"}],
            request_id="resp_p5")),
        ("tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": "Hello there"}),
        ("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
        ("version", "GET", "/version", None),
        ("ping", "GET", "/ping", None),
        ("load", "GET", "/load", None),
        ("models", "GET", "/v1/models", None),
        ("openapi", "GET", "/openapi.json", None),
        ("messages", "POST", "/v1/messages", {"model": MODEL, "max_tokens": 8,
                                              "temperature": 0, "messages": [
                                                  {"role": "user", "content": "Hi"}]}),
        ("invocations", "POST", "/invocations", chat()),
        ("pooling", "POST", "/pooling", {"model": MODEL, "input": "Hi"}),
        ("embeddings", "POST", "/v1/embeddings", {"model": MODEL, "input": "Hi"}),
        ("unknown-route", "GET", "/v1/nope", None),
        ("wrong-method", "GET", "/v1/chat/completions", None),
        # vLLM's refusals
        ("unknown-model", "POST", "/v1/chat/completions", chat(model="gpt-4")),
        ("bad-json", "POST", "/v1/chat/completions", b'{"model": "tiny-llava", "messages": ['),
        ("bad-stream", "POST", "/v1/chat/completions", chat(stream="maybe")),
        ("file-url", "POST", "/v1/chat/completions", image_chat("file:///etc/hostname")),
        ("junk-image", "POST", "/v1/chat/completions", image_chat(JUNK)),
        ("url-404", "POST", "/v1/chat/completions", image_chat(missing_url)),
        ("responses-url-404", "POST", "/v1/responses",
         image_responses(missing_url, request_id="resp_p6")),
        ("too-long", "POST", "/v1/chat/completions", chat(max_tokens=100000)),
    ]


def normalize(value: Any) -> Any:
    """A body with its timestamps dropped and vLLM's random item ids reduced to a prefix."""
    if isinstance(value, dict):
        return {k: (_RANDOM_ID.sub(r"\1", v) if k in _IDS and isinstance(v, str)
                    else normalize(v)) for k, v in value.items() if k not in _TIMES}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def body_of(response: httpx.Response) -> Any:
    """JSON normalized, an SSE stream as its events, anything else as text."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return events(response.text)
    try:
        return normalize(response.json())
    except ValueError:
        return response.text


def events(text: str) -> list[Any]:
    """A stream's events, normalized, with runs of text deltas joined: how many tokens one
    event carries depends on timing (E|P|D's decode often sends more than one at first)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = next((ln[6:] for ln in lines if ln.startswith("data: ")), None)
        if data is None or data == "[DONE]":
            out.extend([data] if data else [])
            continue
        event = normalize(json.loads(data))
        event.pop("sequence_number", None)  # renumbered by the joining
        tail = _final_text(event)
        piece = _text_delta(event) or tail
        last = out[-1] if out else None
        if piece is not None and isinstance(last, dict) and last.get("delta_kind") == piece[0]:
            last["text"] += piece[1]
        elif piece is not None:
            out.append({"event": name, "delta_kind": piece[0], "text": piece[1]})
        if piece is None or tail is not None:
            out.append({"event": name, **event})
    return out


def _final_text(event: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, text) taken out of a finishing chunk: how many tokens arrive with the finish
    is timing too; the chunk stays, with its text emptied."""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("logprobs"):
        return None
    choice = choices[0]
    if choice.get("finish_reason") is None:
        return None
    if isinstance(choice.get("delta"), dict) and choice["delta"].get("content"):
        text, choice["delta"]["content"] = choice["delta"]["content"], ""
        return "chat", text
    if isinstance(choice.get("text"), str) and choice["text"] and "delta" not in choice:
        text, choice["text"] = choice["text"], ""
        return "text", text
    return None


def _text_delta(event: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, text) when the event carries nothing but generated text."""
    kind = event.get("type")
    if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
        return kind, event.get("delta") or ""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or event.get("usage"):
        return None
    choice = choices[0]
    if choice.get("finish_reason") is not None or choice.get("logprobs"):
        return None
    if isinstance(choice.get("delta"), dict) and set(choice["delta"]) == {"content"}:
        return "chat", choice["delta"]["content"] or ""
    if isinstance(choice.get("text"), str) and "delta" not in choice:
        return "text", choice["text"]
    return None


def send(base: str, method: str, path: str, body: Any, rid: str,
         key: str | None = None) -> httpx.Response:
    headers = {"x-request-id": rid, **({"authorization": f"Bearer {key}"} if key else {})}
    kwargs: dict[str, Any] = {"json": body} if not isinstance(body, bytes) else {
        "content": body, "headers": {**headers, "content-type": "application/json"}}
    kwargs.setdefault("headers", headers)
    return httpx.request(method, base + path, timeout=120, **kwargs)


def compare(direct: str, proxy: str, missing_url: str, *, direct_key: str | None = None,
            proxy_key: str | None = None) -> dict[str, tuple[int, Any, Any]]:
    """Every request both ways (each with the key its server wants); the ones that differ
    (name -> status, direct, proxy). A 401 either way is a broken test, not parity."""
    diffs = {}
    for name, method, path, body in requests(missing_url):
        theirs = send(direct, method, path, body, f"parity-{name}", direct_key)
        mine = send(proxy, method, path, body, f"parity-{name}", proxy_key)
        assert 401 not in (theirs.status_code, mine.status_code), (name, theirs.text, mine.text)
        a, b = body_of(theirs), body_of(mine)
        same_type = theirs.headers.get("content-type") == mine.headers.get("content-type")
        if theirs.status_code != mine.status_code or a != b or not same_type:
            diffs[name] = (theirs.status_code, mine.status_code, a, b)
    return diffs


def responses_image_entry(run: TopologyRun, seed: int,
                          api_key: str | None = None) -> dict[str, Any] | None:
    """Send a new image through /v1/responses; its store entry once it has a hit (E saved it
    under the proxy's key, the next stage loaded it), or None."""
    from epdctl.proxy.request.media import content_key

    png = make_image(seed)
    key = content_key("image", png)
    assert cache_entry(run, key) is None, "the image is not new"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.post(run.proxy_url + "/v1/responses", headers=headers,
                       json=image_responses(image_data_url(png)), timeout=120)
    assert reply.status_code == 200, reply.text
    return wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] >= 1 and e)


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def missing_image() -> Iterator[str]:
    """The URL of an image that is not there (a local server answering 404)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/missing.png"
    finally:
        server.shutdown()
        server.server_close()


def bench(proxy: str, tokenizer: Path, tmp: Path, num_prompts: int = 8,
          api_key: str | None = None) -> tuple[str, dict]:
    """`vllm bench serve --backend openai-responses --dataset-name random` through the proxy:
    its output and its result file. `--model` is the served name: without it the bench
    asks /tokenize about the card's `root` (a path vLLM does not serve) and skips alignment,
    straight to vLLM as well."""
    argv = [sys.executable, "-m", "epdctl.engines.vllm_cpu", "bench", "serve",
            "--backend", "openai-responses", "--base-url", proxy, "--endpoint", "/v1/responses",
            "--model", MODEL, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", "4",
            "--num-prompts", str(num_prompts), "--temperature", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp), "--result-filename", "bench.json"]
    # vLLM's bench sends $OPENAI_API_KEY as the bearer token.
    env = {**os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {})}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, json.loads((tmp / "bench.json").read_text())
