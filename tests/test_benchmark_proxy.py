"""benchmarks/proxy.py: the image arms (lookups over stores of 0, 1 000 and 10 000 entries,
none) and the peer's arms in one run, A B .. B A at each level, the first arm rotating."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks" / "proxy.py"
IMAGES = ["image-lookups", "image-no-lookups", "image-lookups-1k", "image-lookups-10k"]


def _bench(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(BENCH), "--seconds", "0.1", *args],
                         capture_output=True, text=True, timeout=180, check=True).stdout
    return out.splitlines()


def _names(rows: list[str], level: int) -> list[str]:
    return [r.split()[1] for r in rows if r.startswith(f"c={level} ")]


def test_image_arms_side_by_side_with_the_order_alternating():
    *rows, summary = _bench("--levels", "1,2")
    assert _names(rows, 1) == ["direct", "proxy", "proxy-stream", *IMAGES, *IMAGES[::-1]]
    second = IMAGES[1:] + IMAGES[:1]  # the next level starts with the next arm
    assert _names(rows, 2) == ["direct", "proxy", "proxy-stream", *second, *second[::-1]]
    keys = dict(kv.split("=") for kv in summary.split())
    assert list(keys) == ["added_p50_ms", "added_p99_ms", "max_rps", "max_rps_image",
                          "image_rps_ratio_lookups", "image_p50_ratio_lookups",
                          "max_rps_stream", "image_rps_ratio_1k", "image_rps_ratio_10k"]
    assert all(float(v) > 0 for k, v in keys.items() if "ratio" in k)


def test_no_store_runs_one_proxy_without_lookups():
    *rows, summary = _bench("--levels", "1", "--no-store")
    assert [r.split()[1] for r in rows] == ["direct", "proxy", "proxy-stream", "proxy-image"]
    assert [kv.split("=")[0] for kv in summary.split()] == [
        "added_p50_ms", "added_p99_ms", "max_rps", "max_rps_image", "max_rps_stream"]


def test_a_peer_arm_beside_each_of_epdctls(tmp_path: Path):
    """Any proxy that takes the example proxy's flags: here epdctl's own, behind a shim."""
    shim = tmp_path / "peer.py"
    shim.write_text(
        "import argparse, sys\n"
        "from epdctl.proxy.__main__ import main\n"
        "p = argparse.ArgumentParser()\n"
        "for f in ('--host', '--port', '--encode-servers-urls', '--prefill-servers-urls',\n"
        "          '--decode-servers-urls'):\n"
        "    p.add_argument(f)\n"
        "a = p.parse_args()\n"
        "main(['--host', a.host, '--port', a.port, '--model', 'm',\n"
        "      '--encode', a.encode_servers_urls, '--prefill-decode', a.decode_servers_urls])\n")
    *rows, summary = _bench("--levels", "1", "--no-store", "--peer", str(shim))
    assert [r.split()[1] for r in rows] == [
        "direct", "proxy", "peer", "peer", "proxy", "proxy-stream", "peer-stream",
        "peer-stream", "proxy-stream", "proxy-image", "peer-image", "peer-image",
        "proxy-image"]
    keys = dict(kv.split("=") for kv in summary.split())
    assert list(keys)[-3:] == ["text_rps_ratio_peer", "stream_rps_ratio_peer",
                               "image_rps_ratio_peer"]
    assert all(float(keys[k]) > 0 for k in list(keys)[-3:])
