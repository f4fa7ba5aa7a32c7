"""A stdlib stand-in for `vllm serve`: /health, /v1/models, chat and text completions.

Used as `engine.command: [python, tests/fake_server.py]`; vLLM arguments it does not know
(model, --ec-transfer-config JSON, ...) are accepted and ignored. With VLLM_API_KEY in its
environment it answers 401 without `authorization: Bearer <key>` on every route but
/health, as vLLM with epdctl's guard middleware does.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FLAGS = {"--port": int, "--host": str, "--ready-after": float, "--exit-after": float,
         "--exit-code": int, "--model": str, "--served-model-name": str,
         "--answer-after": float}
SWITCHES = {"--ignore-sigterm", "--spawn-grandchild", "--shm-file", "--semaphore",
            "--ipc-socket"}


def parse(argv: list[str]) -> dict:
    """Known flags by hand: argparse chokes on vLLM's JSON values and unknown flags."""
    opts: dict = {"--port": 8000, "--host": "127.0.0.1", "--ready-after": 0.0,
                  "--exit-after": None, "--exit-code": 1, "--model": None,
                  "--answer-after": 0.0}
    positional = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, _, inline = arg.partition("=")
        if key in FLAGS:
            value = inline if inline else argv[i + 1]
            opts[key] = FLAGS[key](value)
            i += 1 if inline else 2
            continue
        if arg in SWITCHES:
            opts[arg] = True
        elif not arg.startswith("-"):
            positional.append(arg)
        i += 1
    opts["--model"] = opts.get("--served-model-name") or opts["--model"] or (
        positional[0] if positional else "fake-model")
    return opts


def make_handler(model: str, ready_at: float,
                 answer_after: float = 0.0) -> type[BaseHTTPRequestHandler]:
    """`answer_after`: seconds a completion takes (a streamed one: after its first word),
    for requests that are still in flight when a test acts."""
    key = os.environ.get("VLLM_API_KEY")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: probes just close

        def log_message(self, fmt: str, *args: object) -> None:
            print(f"fake: {self.command} {self.path}", flush=True)

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            if str(code) == "401":  # worded so that it does not count as a served request
                print(f"fake: refused {self.path} ({self.command}, 401)", flush=True)
            else:
                self.log_message("")

        def _json(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _is_refused(self) -> bool:
            if key is None or self.path == "/health" or (
                    self.headers.get("authorization") == f"Bearer {key}"):
                return False
            self._json(401, {"error": "Unauthorized"})
            return True

        def do_GET(self) -> None:
            if self._is_refused():
                return
            if self.path == "/health":
                if time.monotonic() >= ready_at:
                    self._json(200, {})
                else:
                    self._json(503, {"error": "starting"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self._is_refused():
                return
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            text = "hello from fake"
            if body.get("stream"):
                self._stream(chat, text)
                return
            time.sleep(answer_after)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "stop"} if chat else
                      {"index": 0, "text": text, "finish_reason": "stop"})
            self._json(200, {"id": "fake-1", "object": "chat.completion" if chat else
                             "text_completion", "created": int(time.time()), "model": model,
                             "choices": [choice],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 3,
                                       "total_tokens": 4}})

        def _stream(self, chat: bool, text: str) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            for word in text.split(" "):
                delta = ({"index": 0, "delta": {"content": word + " "}, "finish_reason": None}
                         if chat else {"index": 0, "text": word + " ", "finish_reason": None})
                chunk = {"id": "fake-1", "object": "chat.completion.chunk" if chat else
                         "text_completion", "created": int(time.time()), "model": model,
                         "choices": [delta]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(answer_after / 3)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


def main() -> None:
    if sys.argv[1:2] == ["--grandchild"]:
        # Ignores SIGTERM like a stuck worker: only the group SIGKILL reaches it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    opts = parse(sys.argv[1:])
    if opts.get("--ignore-sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if opts.get("--shm-file"):
        # Like vLLM's message queues: a mapped /dev/shm file only a clean exit would unlink.
        path = f"/dev/shm/epdctl-test-fake-{os.getpid()}"
        with open(path, "wb+") as f:
            f.truncate(4096)
            opts["shm"] = mmap.mmap(f.fileno(), 4096)
        print(f"fake: mapped {path}", flush=True)
    if opts.get("--semaphore"):
        # Like vLLM's engines: a multiprocessing lock of the spawn context is a named
        # semaphore, /dev/shm/sem.mp-*, that its resource tracker unlinks at exit (and that
        # stays when the tracker is SIGKILLed with the group).
        import multiprocessing

        opts["lock"] = multiprocessing.get_context("spawn").Lock()
        print(f"fake: semaphore {opts['lock']._semlock.name}", flush=True)
    if opts.get("--ipc-socket"):
        # Like vLLM's ZMQ IPC endpoints: a unix socket bound as $VLLM_RPC_BASE_PATH/<uuid>
        # (default /tmp), which nothing unlinks when the process dies.
        import socket
        import tempfile
        import uuid

        base = os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir())
        opts["ipc"] = socket.socket(socket.AF_UNIX)
        opts["ipc"].bind(f"{base}/{uuid.uuid4()}")
        # And like its torch.distributed file store, $TMPDIR/vllm_dist_<uuid>.
        os.close(tempfile.mkstemp(prefix="vllm_dist_")[0])
        print(f"fake: bound {base}", flush=True)
    if opts.get("--spawn-grandchild"):
        child = subprocess.Popen([sys.executable, __file__, "--grandchild"])
        print(f"fake: grandchild pid {child.pid}", flush=True)
    if opts["--exit-after"] is not None:
        def leave() -> None:
            print(f"fake: exiting with code {opts['--exit-code']}", flush=True)
            os._exit(opts["--exit-code"])
        threading.Timer(opts["--exit-after"], leave).start()
    ready_at = time.monotonic() + opts["--ready-after"]
    server = ThreadingHTTPServer((opts["--host"], opts["--port"]),
                                 make_handler(opts["--model"], ready_at,
                                              opts["--answer-after"]))
    print(f"fake: serving {opts['--model']} on {opts['--host']}:{opts['--port']} "
          f"pid {os.getpid()}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
