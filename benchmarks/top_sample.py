"""The README's `epdctl top` sample: topologies/cpu-demo.yaml up in a private state dir, 180
chat requests from 4 clients (120 with one or two of 9 distinct 56x56 images, 60 text-only,
max_tokens 8), then `epdctl top --once`, then down. Run it alone (it takes both cores):

    .venv/bin/python benchmarks/top_sample.py     # after scripts/demo-cpu.sh built the model

Ends with one key=value line: the requests that answered 200, of all sent.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from PIL import Image

REQUESTS, CLIENTS, IMAGES = 180, 4, 9


def image(index: int) -> str:
    data = io.BytesIO()
    Image.new("RGB", (56, 56), (index * 25 % 256, 90, 200 - index * 20)).save(data, "PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


def bodies(model: str) -> list[dict[str, Any]]:
    images, rng, out = [image(i) for i in range(IMAGES)], random.Random(7), []
    for n in range(REQUESTS):
        content: Any = "Say something short."
        if n % 3 != 2:
            content = [{"type": "text", "text": "What is in the image?"}] + [
                {"type": "image_url", "image_url": {"url": u}}
                for u in rng.sample(images, rng.choice((1, 2)))]
        out.append({"model": model, "messages": [{"role": "user", "content": content}],
                    "max_tokens": 8, "temperature": 0})
    return out


def main() -> None:
    state = tempfile.mkdtemp(prefix="epdctl-top-sample-")
    epdctl = [sys.executable, "-m", "epdctl", "--state-dir", state]
    subprocess.run([*epdctl, "up", "topologies/cpu-demo.yaml", "-d"], check=True)
    try:
        status = json.loads(subprocess.run([*epdctl, "status", "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        url = status["proxy_url"]

        def send(body: dict[str, Any]) -> int:
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(CLIENTS) as pool:
            codes = list(pool.map(send, bodies("tiny-llava")))
        env = {**os.environ, "COLUMNS": "130"}  # the whole table, not a terminal's width
        print(subprocess.run([*epdctl, "top", "--once"], capture_output=True, text=True,
                             env=env).stdout)
    finally:
        subprocess.run([*epdctl, "down"], check=False)
        shutil.rmtree(state, ignore_errors=True)
    print(f"requests_ok={codes.count(200)} requests={len(codes)}")


if __name__ == "__main__":
    main()
