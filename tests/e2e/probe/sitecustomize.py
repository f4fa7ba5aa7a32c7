"""Test-only probe: logs media loads and HF-processor calls of every process that imports it.

Put this directory on PYTHONPATH (through a role's env in a test topology) and name a file
in EPDCTL_PROBE_FILE: each `vllm` process of the instance (API server, engine core) then
appends one line per call, `<time> <pid> <kind> <detail>`:

- `media <scheme> <bytes>`: MediaConnector.load_from_url(_async), i.e. fetching or decoding
  an image/audio/video from its URL (data URLs included);
- `hf_processor images=<n> ...`: InputProcessingContext.call_hf_processor, the HF processor
  call that preprocesses media (n = images handed to it; text-only calls have n = 0).

vLLM's own logs show neither, so this is how a test proves that PD never touched an image.
Nothing happens when EPDCTL_PROBE_FILE is unset.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

PROBE_ENV = "EPDCTL_PROBE_FILE"


def record(kind: str, detail: str) -> None:
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    line = f"{time.time():.3f} {os.getpid()} {kind} {detail}\n".encode()
    # O_APPEND: one short write per line, so processes sharing the file never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _url_detail(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    url = str(args[0] if args else kwargs.get("url", ""))
    return f"{url.partition(':')[0] or '?'} {len(url)}"


def _count(value: Any) -> int:
    if value is None:
        return 0
    return len(value) if isinstance(value, list | tuple) else 1


def _patch_connector(module: Any) -> None:
    cls = module.MediaConnector
    sync, async_ = cls.load_from_url, cls.load_from_url_async

    @functools.wraps(sync)
    def load_from_url(self: Any, *args: Any, **kwargs: Any) -> Any:
        record("media", _url_detail(args, kwargs))
        return sync(self, *args, **kwargs)

    @functools.wraps(async_)
    async def load_from_url_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        record("media", _url_detail(args, kwargs))
        return await async_(self, *args, **kwargs)

    cls.load_from_url, cls.load_from_url_async = load_from_url, load_from_url_async


def _patch_context(module: Any) -> None:
    cls = module.InputProcessingContext
    original = cls.call_hf_processor

    @functools.wraps(original)
    def call_hf_processor(self: Any, hf_processor: Any, data: Any, *args: Any, **kw: Any) -> Any:
        keys = ",".join(sorted(k for k, v in dict(data).items() if v is not None))
        record("hf_processor", f"images={_count(dict(data).get('images'))} keys={keys}")
        return original(self, hf_processor, data, *args, **kw)

    cls.call_hf_processor = call_hf_processor


PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.multimodal.media.connector": _patch_connector,
    "vllm.multimodal.processing.context": _patch_context,
}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the fresh module."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module)
        record("patched", module.__name__)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules in PATCHES with the other finders and wraps their loaders."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
                return spec
        return None


if os.environ.get(PROBE_ENV):
    sys.meta_path.insert(0, _Finder())
