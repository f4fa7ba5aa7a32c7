"""The restart request folder: a request still being written is not taken."""

from __future__ import annotations

from pathlib import Path

from epdctl.launch.restart_one import REQUESTS, take


def test_a_request_being_written_is_left_to_its_writer(tmp_path: Path) -> None:
    folder = tmp_path / REQUESTS
    folder.mkdir()
    (folder / ".pd-0.5gyc8ibn.tmp").write_bytes(b"")  # write_file's temp, not renamed yet
    (folder / "pd-1").write_bytes(b"")
    assert take(tmp_path) == ["pd-1"]
    assert (folder / ".pd-0.5gyc8ibn.tmp").exists() and not (folder / "pd-1").exists()
