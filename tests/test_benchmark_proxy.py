"""benchmarks/proxy.py: both image arms (lookups, none) in one run, A B B A at each level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks" / "proxy.py"


def _bench(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(BENCH), "--seconds", "0.1", *args],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.splitlines()


def test_image_arms_side_by_side_with_the_order_alternating():
    *rows, summary = _bench("--levels", "1,2")
    assert [tuple(r.split()[:2]) for r in rows] == [
        ("c=1", "direct"), ("c=1", "proxy"), ("c=1", "image-lookups"),
        ("c=1", "image-no-lookups"), ("c=1", "image-no-lookups"), ("c=1", "image-lookups"),
        ("c=2", "direct"), ("c=2", "proxy"), ("c=2", "image-no-lookups"),
        ("c=2", "image-lookups"), ("c=2", "image-lookups"), ("c=2", "image-no-lookups")]
    keys = dict(kv.split("=") for kv in summary.split())
    assert list(keys) == ["added_p50_ms", "added_p99_ms", "max_rps", "max_rps_image",
                          "image_rps_ratio_lookups", "image_p50_ratio_lookups"]
    assert all(float(v) > 0 for k, v in keys.items() if "ratio" in k)


def test_no_store_runs_one_proxy_without_lookups():
    *rows, summary = _bench("--levels", "1", "--no-store")
    assert [r.split()[1] for r in rows] == ["direct", "proxy", "proxy-image"]
    assert [kv.split("=")[0] for kv in summary.split()] == [
        "added_p50_ms", "added_p99_ms", "max_rps", "max_rps_image"]
