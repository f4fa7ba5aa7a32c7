"""Fixtures for end-to-end tests with real vLLM (CPU build): tiny models and a baseline server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm_harness import Server, start_vllm, wait_all_ready

READY_TIMEOUT_S = 300.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is an e2e test (`-m 'not e2e'` skips them all)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)


def _tiny_model(kind: str, request: pytest.FixtureRequest) -> Path:
    pytest.importorskip("vllm", reason="e2e tests need vLLM (scripts/setup-cpu.sh)")
    from epdctl.dev.tiny_models import CACHE_ENV, ensure_model

    # Built once into the pytest cache (reused across runs while the recipe is unchanged),
    # or this run's temp dir under `-p no:cacheprovider`; $EPDCTL_TINY_MODEL_DIR overrides.
    cache = getattr(request.config, "cache", None)
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif cache is not None:
        root = cache.mkdir("tiny-models")
    else:
        root = request.getfixturevalue("tmp_path_factory").getbasetemp() / "tiny-models"
    return ensure_model(kind, root)


@pytest.fixture(scope="session")
def tiny_llava(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight LLaVA (CLIP 56 px, 16 image tokens, Llama LM)."""
    return _tiny_model("llava", request)


@pytest.fixture(scope="session")
def tiny_qwen2vl(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight Qwen2-VL (M-RoPE, images up to 112x112)."""
    return _tiny_model("qwen2vl", request)


@pytest.fixture(scope="session")
def tiny_qwen2audio(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight Qwen2-Audio (Whisper-style tower, Qwen2 LM)."""
    return _tiny_model("qwen2audio", request)


def serve(model: Path, log_path: Path, name: str) -> Iterator[Server]:
    """Start one aggregated server, yield it when ready, stop its process group after."""
    server = start_vllm(model, log_path=log_path, name=name)
    try:
        wait_all_ready([server], READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def baseline_llava(
    tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """An aggregated vLLM server for tiny_llava: the reference outputs for a module."""
    log = tmp_path_factory.mktemp("baseline-llava") / "server.log"
    yield from serve(tiny_llava, log, "baseline-llava")


@pytest.fixture(scope="module")
def baseline_qwen2vl(
    tiny_qwen2vl: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """An aggregated vLLM server for tiny_qwen2vl: the reference outputs for a module."""
    log = tmp_path_factory.mktemp("baseline-qwen2vl") / "server.log"
    yield from serve(tiny_qwen2vl, log, "baseline-qwen2vl")
