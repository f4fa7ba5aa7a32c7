"""Old tiny-model builds do not pile up in the cache (no build needed for these tests)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from epdctl.dev.tiny_models import STALE_BUILD_S, STAMP, prune_stale


def fake_build(root: Path, name: str, used_s_ago: float) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / STAMP).write_text("{}")
    then = time.time() - used_s_ago
    os.utime(path / STAMP, (then, then))
    return path


def test_builds_of_other_recipes_unused_for_long_are_removed(tmp_path: Path) -> None:
    current = fake_build(tmp_path, "llava-new", 10 * STALE_BUILD_S)  # in use: never removed
    old = fake_build(tmp_path, "llava-old", STALE_BUILD_S + 60)
    recent = fake_build(tmp_path, "llava-recent", 60)  # another checkout may still use it
    other_kind = fake_build(tmp_path, "qwen2vl-old", STALE_BUILD_S + 60)
    partial = tmp_path / "llava-partial"  # no stamp: not a finished build of ours
    partial.mkdir()
    (tmp_path / "llava").symlink_to(old, target_is_directory=True)
    assert prune_stale(tmp_path, "llava", keep=current) == [old]
    assert current.is_dir() and recent.is_dir() and other_kind.is_dir() and partial.is_dir()
    assert not old.exists()
