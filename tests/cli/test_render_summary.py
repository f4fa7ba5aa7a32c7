from __future__ import annotations

from epdctl.cli.views import summary
from epdctl.launch.state import RunState, SpecModel


def _state(proxy_env: dict[str, str]) -> RunState:
    pd = SpecModel(name="pd-0", role="prefill_decode", command=["x"], env={}, port=8101,
                   log_path="/l")
    proxy = SpecModel(name="proxy", role="proxy", command=["p"], env=proxy_env, port=8000,
                      log_path="/p")
    return RunState(name="demo", topology_path="/t.yaml", created_at=1.0, mode="pd",
                    namespace="ns", store_dir="/s", model_name="m", specs=[pd, proxy])


def test_summary_curl_names_the_api_key_without_printing_it() -> None:
    text = summary(_state({"EPDCTL_PROXY_API_KEY": "s3cret"})).plain
    assert "authorization: Bearer <proxy.api_key from the topology>" in text
    assert "s3cret" not in text
    plain = summary(_state({})).plain
    assert "authorization" not in plain
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in plain
