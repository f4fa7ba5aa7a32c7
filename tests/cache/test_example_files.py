"""ECExampleConnector's files as `cache inspect/clean` and `verify` read them."""

from __future__ import annotations

import os
from pathlib import Path

from epdctl.cache.example_files import item_file, list_items, remove, select

NOW = 1_000_000.0


def _item(root: Path, key: str, size: int, age_s: float) -> None:
    path = item_file(root, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(size))
    os.utime(path, (NOW - age_s, NOW - age_s))


def test_items_are_complete_files_most_recent_first(tmp_path: Path) -> None:
    _item(tmp_path, "a", 10, 300)
    _item(tmp_path, "b", 20, 10)
    (tmp_path / "half").mkdir()  # the connector makes the folder before it writes the file
    (tmp_path / "stray.txt").write_text("x")
    assert [(i.key, i.size_bytes) for i in list_items(tmp_path)] == [("b", 20), ("a", 10)]
    assert list_items(tmp_path / "missing") == []


def test_select_by_age_then_oldest_first_down_to_the_budget(tmp_path: Path) -> None:
    for key, size, age in (("old", 100, 7200), ("mid", 100, 600), ("new", 100, 5)):
        _item(tmp_path, key, size, age)
    items = list_items(tmp_path)

    def keys(**kw: object) -> list[tuple[str, str]]:
        return sorted((i.key, why) for i, why in select(items, now=NOW, **kw))  # type: ignore

    assert keys(remove_all=True) == [("mid", "all"), ("new", "all"), ("old", "all")]
    assert keys(older_than_s=3600) == [("old", "older-than")]
    assert keys(max_bytes=150) == [("mid", "budget"), ("old", "budget")]
    assert keys(older_than_s=3600, max_bytes=150) == [("mid", "budget"), ("old", "older-than")]
    assert keys() == []
    remove(tmp_path, [i for i, _ in select(items, older_than_s=3600, now=NOW)])
    assert [i.key for i in list_items(tmp_path)] == ["new", "mid"]
    assert not (tmp_path / "old").exists()
