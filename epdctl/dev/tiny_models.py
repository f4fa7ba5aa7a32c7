"""Tiny multimodal models with random weights, built offline in seconds for CPU tests.

Three recipes (see /work/shared/vllm-cpu.md): a LLaVA (CLIP + Llama, 56 px images, 16 image
tokens), a Qwen2-VL (M-RoPE; images and videos, frames capped at 112x112) and a Qwen2-Audio
(Whisper-style audio tower + Qwen2 LM; audio clips). All share a byte-level BPE tokenizer
trained in-process and a ChatML template with a placeholder per modality the model takes.
Builds are deterministic: the same recipe gives the same bytes, so the same item gives the
same greedy output. The recipes are in _recipes.py, the shared tokenizer and template in
_tokenizer.py, the weights made decisive in _weights.py; this module caches the builds and
is the command line.

Why Qwen2-Audio for audio (not Ultravox): vLLM 0.32's Qwen2-Audio keeps its whole audio
tower behind `_mark_tower_model(..., "audio")` (vllm/model_executor/models/qwen2_audio.py,
`Qwen2AudioForConditionalGeneration.__init__`), so an `ec_producer` runs it alone and a
consumer loads its output by mm_hash like any image's; its data parser declares
`audio_num_tokens` as the audio metadata (`Qwen2AudioMultiModalDataParser.embedding_fields`),
so E reports it and the proxy can rewrite an audio part to `audio_embeds`. Its config and
processor are plain transformers classes (`Qwen2AudioConfig`, `Qwen2AudioProcessor` with a
`WhisperFeatureExtractor`), built offline; Ultravox needs a remote-code-style config whose
text model vLLM resolves by name (`text_model_id`), which an offline build cannot give.
The audio tower's input is fixed at 3000 mel frames (30 s, `Qwen2AudioFeatureInputs`), so
one clip can take up to 750 tokens: the audio topology runs with `--max-model-len 1024`.

    python -m epdctl.dev.tiny_models llava   # -> ~/.cache/epdctl/tiny-models/llava (a symlink)
    python -m epdctl.dev.tiny_models qwen2vl --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from epdctl.dev._recipes import BUILDERS
from epdctl.dev._recipes import audio_weight_name as audio_weight_name
from epdctl.dev._tokenizer import chat_template as chat_template

KINDS = ("llava", "qwen2vl", "qwen2audio")
CACHE_ENV = "EPDCTL_TINY_MODEL_DIR"
STAMP = "epdctl-tiny-model.json"
STALE_BUILD_S = 14 * 86400  # a build of another recipe unused this long is removed
RECIPE_FILES = ("tiny_models.py", "_recipes.py", "_tokenizer.py", "_weights.py")
"""The files of epdctl/dev/ whose bytes are the recipe (recipe_hash)."""


def recipe_hash() -> str:
    """Identifies the recipe: its files plus the versions that shape the saved files."""
    import importlib.metadata as md

    here = Path(__file__).parent
    material = b"".join((here / name).read_bytes() for name in RECIPE_FILES)
    for dist in ("transformers", "tokenizers", "safetensors"):
        try:
            material += f"{dist}={md.version(dist)}".encode()
        except md.PackageNotFoundError:
            pass
    return hashlib.sha256(material).hexdigest()[:12]


def build(kind: str, path: str | Path) -> Path:
    """Build the `kind` tiny model into `path` (created or replaced atomically)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {', '.join(KINDS)}")
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        BUILDERS[kind](tmp)
        (tmp / STAMP).write_text(
            json.dumps({"kind": kind, "recipe": recipe_hash()}, indent=2) + "\n")
        for child in tmp.iterdir():
            child.chmod(0o644)  # safetensors and mkdtemp default to owner-only
        tmp.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def build_llava(path: str | Path) -> Path:
    """Build the tiny LLaVA into `path`; returns the resolved directory."""
    return build("llava", path)


def build_qwen2vl(path: str | Path) -> Path:
    """Build the tiny Qwen2-VL into `path`; returns the resolved directory."""
    return build("qwen2vl", path)


def build_qwen2audio(path: str | Path) -> Path:
    """Build the tiny Qwen2-Audio into `path`; returns the resolved directory."""
    return build("qwen2audio", path)


def default_cache_root() -> Path:
    """$EPDCTL_TINY_MODEL_DIR, else ~/.cache/epdctl/tiny-models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epdctl" / "tiny-models"


def is_built(path: Path, kind: str) -> bool:
    """True when `path` holds a complete build of `kind` from the current recipe."""
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"kind": kind, "recipe": recipe_hash()}


def ensure_model(kind: str, cache_root: str | Path | None = None) -> Path:
    """The cached `<root>/<kind>-<recipe hash>` directory, built on first use.

    Each use marks the build used now; builds of other recipes unused for STALE_BUILD_S
    (an older epdctl, transformers or vLLM) are removed.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {', '.join(KINDS)}")
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    path = (root / f"{kind}-{recipe_hash()}").resolve()
    if not is_built(path, kind):
        root.mkdir(parents=True, exist_ok=True)
        # Two test runs may race to build: the second waits, then finds the build done.
        with open(root / f".{kind}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_built(path, kind):
                build(kind, path)
    with contextlib.suppress(OSError):
        os.utime(path / STAMP)
    prune_stale(root, kind, keep=path)
    return path


def prune_stale(root: Path, kind: str, *, keep: Path, now: float | None = None) -> list[Path]:
    """Remove `<root>/<kind>-*` builds other than `keep` unused for STALE_BUILD_S."""
    now = time.time() if now is None else now
    removed = []
    for other in root.glob(f"{kind}-*"):
        if other.resolve() == keep or other.is_symlink() or not other.is_dir():
            continue
        try:
            used = (other / STAMP).stat().st_mtime
        except OSError:
            continue  # not a finished build of ours
        if now - used > STALE_BUILD_S:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    return removed


def link_model(kind: str, link: str | Path, cache_root: str | Path | None = None) -> Path:
    """Point the stable path `link` (a symlink) at the cached build; returns the link."""
    target = ensure_model(kind, cache_root)
    link = Path(link).expanduser()
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)  # atomic, so a running topology never sees a missing link
    return link


def stable_path(kind: str, cache_root: str | Path | None = None) -> Path:
    """`<root>/<kind>`: a symlink to the current build, the path CPU topologies name."""
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    return link_model(kind, root / kind, root)


def main(argv: list[str] | None = None) -> int:
    """Build a tiny model (or reuse the cached build) and print its directory."""
    parser = argparse.ArgumentParser(prog="python -m epdctl.dev.tiny_models",
                                     description=main.__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--out", type=Path,
                        help="build into this directory instead of the cache")
    parser.add_argument("--link", type=Path,
                        help="point this symlink at the cached build "
                             "(default: <cache>/<kind>, e.g. ~/.cache/epdctl/tiny-models/llava)")
    args = parser.parse_args(argv)
    if args.out:
        path = build(args.kind, args.out)
    elif args.link:
        path = link_model(args.kind, args.link)
    else:
        path = stable_path(args.kind)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
