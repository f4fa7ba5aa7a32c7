"""`up --dry-run` with proxy.api_key: each key is shown as a placeholder, never its value."""

from __future__ import annotations

import re

from tests.reliability.helpers import edit_topology


def test_dry_run_shows_placeholders_for_the_keys(epdctl, fake_topology, state_root) -> None:
    def with_key(data: dict) -> None:
        data["proxy"]["api_key"] = "s3cret-outside"

    topo = edit_topology(fake_topology(), with_key)
    result = epdctl("up", str(topo), "--dry-run")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "s3cret-outside" not in out
    keys = re.findall(r"\b(VLLM_API_KEY|EPDCTL_PROXY_UPSTREAM_KEY|EPDCTL_PROXY_API_KEY)=(\S+)",
                      out)
    assert sorted(keys) == sorted([("VLLM_API_KEY", "<internal>")] * 2 + [
        ("EPDCTL_PROXY_API_KEY", "<proxy.api_key>"), ("EPDCTL_PROXY_UPSTREAM_KEY", "<internal>")])
    assert out.count("--middleware epdctl.engines.guard.RequireKey") == 2
    assert not (state_root / "fake").exists()
