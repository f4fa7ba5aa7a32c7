from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def test_logs_of_a_stopped_topology(epdctl, fake_topology, state_root) -> None:
    assert epdctl("up", str(fake_topology()), "-d", "--timeout", "20").exit_code == 0
    assert epdctl("down").exit_code == 0
    result = epdctl("logs", "-n", "1", "pd-0", "proxy")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    # One line of each, in the order they were written (which came last depends on when
    # the fake proxy's last health probe ran: not the test's to fix).
    named = [re.fullmatch(r"\d\d:\d\d:\d\d (pd-0 |proxy) \| .+", line) for line in lines]
    assert all(named) and sorted(m.group(1) for m in named if m) == ["pd-0 ", "proxy"], lines
    assert "\x1b[" not in result.stdout  # NO_COLOR and not a TTY

    everything = epdctl("logs", "-n", "2")
    names = [line.split()[1] for line in everything.stdout.splitlines()]
    assert names == ["encode-0"] * 2 + ["pd-0"] * 2 + ["proxy"] * 2  # supervisor.log is empty
    header = epdctl("logs", "-n", "1000", "encode-0").stdout.splitlines()[0]
    assert re.fullmatch(r"\S+ encode-0 \| --- epdctl start \S+ .*fake_server\.py .*", header)


def test_unknown_instance(epdctl, fake_topology, state_root) -> None:
    assert epdctl("up", str(fake_topology()), "-d", "--timeout", "20").exit_code == 0
    result = epdctl("logs", "nope")
    assert result.exit_code == 1
    assert result.stderr == ("Error: no instance `nope` in fake "
                             "(instances: encode-0, pd-0, proxy, supervisor)\n")
    assert epdctl("down").exit_code == 0


def _vllm(moment: datetime, text: str) -> str:
    return f"(APIServer pid=1) INFO {moment:%m-%d %H:%M:%S} [a.py:1] {text}"


PROBE = 'INFO:     127.0.0.1:51208 - "GET /health HTTP/1.1" 200 OK'


@pytest.fixture
def past_run(state_root: Path) -> Callable[..., Path]:
    """A topology `demo` that was brought down: last-run.json (optional) and its logs."""

    def write(logs: dict[str, list[str]], *, log_requests: bool | None = None) -> Path:
        run_dir = state_root / "demo"
        (run_dir / "logs").mkdir(parents=True)
        for name, rows in logs.items():
            (run_dir / "logs" / f"{name}.log").write_text("".join(f"{r}\n" for r in rows))
        if log_requests is not None:
            from epdctl.launch.plan import plan
            from epdctl.launch.state import RunState, Settings
            from epdctl.topology.model import parse_topology

            topology = parse_topology({
                "name": "demo", "model": "m", "device": "cpu", "roles": {
                    "encode": {}, "prefill_decode": {}},
                "engine": {"log_requests": log_requests}})
            state = RunState.of(plan(topology, run_dir), "demo.yaml", Settings())
            (run_dir / "last-run.json").write_text(state.model_dump_json())
        return run_dir

    return write


def test_history_is_merged_in_time_order_without_probes(epdctl, past_run) -> None:
    now = datetime.now().replace(microsecond=0)
    t = [now - timedelta(seconds=s) for s in (30, 20, 10)]
    past_run({"encode-0": [_vllm(t[0], "E first"), PROBE, _vllm(t[2], "E third")],
              "pd-0": [PROBE, _vllm(t[1], "PD second"), PROBE]})
    result = epdctl("logs", "--name", "demo")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "".join(f"{x:%H:%M:%S} {n} | {_vllm(x, text)}\n" for x, n, text in [
        (t[0], "encode-0", "E first"), (t[1], "pd-0    ", "PD second"),
        (t[2], "encode-0", "E third")])
    every = epdctl("logs", "--name", "demo", "--all")
    assert every.stdout.count("GET /health") == 3
    encode = [row[20:] for row in every.stdout.splitlines() if " encode-0 " in row]
    assert encode[:2] == [_vllm(t[0], "E first"), PROBE]  # in its place in its file


def test_since_grep_and_json(epdctl, past_run) -> None:
    now = datetime.now().replace(microsecond=0)
    old, recent = now - timedelta(minutes=20), now - timedelta(minutes=5)
    past_run({"pd-0": [_vllm(old, "old one"), _vllm(recent, "recent one"),
                       _vllm(recent, "recent two"), "no time: inherits the recent one"]})
    since = epdctl("logs", "--name", "demo", "--since", "10m")
    assert since.exit_code == 0, since.stderr
    assert [row.split("] ")[-1] if "]" in row else row.split(" ~ ")[-1]
            for row in since.stdout.splitlines()] == [
        "recent one", "recent two", "no time: inherits the recent one"]
    assert " ~ no time" in since.stdout
    grep = epdctl("logs", "--name", "demo", "--grep", r"\] \w+ one$", "-n", "5")
    assert [row.rsplit(" ", 2)[-2:] for row in grep.stdout.splitlines()] == [
        ["old", "one"], ["recent", "one"]]
    as_json = epdctl("logs", "--name", "demo", "--json", "-n", "2")
    docs = [json.loads(row) for row in as_json.stdout.splitlines()]
    assert [(d["instance"], d["time_source"], d["text"][-10:]) for d in docs] == [
        ("pd-0", "own", "recent two"), ("pd-0", "inherited", "recent one")]
    assert docs[0]["time"] == recent.astimezone().isoformat(timespec="milliseconds")
    assert docs[1]["time"] == docs[0]["time"]


def test_bad_since_grep_and_combinations(epdctl, past_run) -> None:
    past_run({"pd-0": ["x"]})
    bad_age = epdctl("logs", "--name", "demo", "--since", "soon")
    assert bad_age.exit_code == 2 and "expected a duration such as 30s" in bad_age.stderr
    bad_grep = epdctl("logs", "--name", "demo", "--grep", "(")
    assert bad_grep.exit_code == 2 and "not a regular expression" in bad_grep.stderr
    both = epdctl("logs", "--name", "demo", "--request", "r", "-f")
    assert both.exit_code == 2 and "--request and --follow do not go together" in both.stderr


def test_request_journey(epdctl, past_run) -> None:
    now = datetime.now().replace(microsecond=0)
    proxy = (f"{now:%Y-%m-%d %H:%M:%S},500 INFO epdctl.proxy: rid=abc route=/v1/chat/"
             "completions status=200 total_ms=12.5 encode_ms=4.0 decode_ms=8.0 items=1")
    past_run({
        "encode-0": [_vllm(now - timedelta(seconds=2), "Received request chatcmpl-abc:enc0: p"),
                     _vllm(now, "Received request chatcmpl-abcd:enc0: p")],
        "pd-0": [_vllm(now - timedelta(seconds=1), "Added request chatcmpl-abc:decode-01234567.")],
        "proxy": [proxy]}, log_requests=True)
    result = epdctl("logs", "--name", "demo", "--request", "chatcmpl-abc:decode")
    assert result.exit_code == 0, result.stderr
    rows = result.stdout.splitlines()
    assert [row.split(" | ")[0].split()[1] for row in rows] == ["proxy", "encode-0", "pd-0"]
    assert rows[0].endswith(proxy) and "abcd" not in result.stdout
    assert result.stderr == ""
    missing = epdctl("logs", "--name", "demo", "--request", "zzz")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("Error: no line of ") and "names request `zzz`" in (
        missing.stderr)


@pytest.mark.parametrize("given", ["chatcmpl-abc", "abc"])
def test_request_journey_by_response_id_and_rid(epdctl, past_run, given: str) -> None:
    """The final stage gets the client's rid as is: PD logs `chatcmpl-abc` (the response id)
    and, inside the engine, `chatcmpl-abc-<8 hex>`; E gets `abc:enc0`."""
    now = datetime.now().replace(microsecond=0)
    proxy = (f"{now:%Y-%m-%d %H:%M:%S},500 INFO epdctl.proxy: rid=abc route=/v1/chat/"
             "completions status=200 total_ms=12.5 encode_ms=4.0 decode_ms=8.0 items=1")
    earlier = [now - timedelta(seconds=s) for s in (3, 2, 1)]
    past_run({
        "encode-0": [_vllm(earlier[0], "Received request chatcmpl-abc:enc0: p"),
                     _vllm(earlier[0], "Added request chatcmpl-abc:enc0-8f9e7d6c."),
                     _vllm(now, "Received request chatcmpl-abcd:enc0: p")],
        "pd-0": [_vllm(earlier[1], "Received request chatcmpl-abc: p"),
                 _vllm(earlier[2], "Added request chatcmpl-abc-01234567."),
                 _vllm(now, "Received request chatcmpl-abcd: p"),
                 _vllm(now, "Added request chatcmpl-abcd-01234567.")],
        "proxy": [proxy]}, log_requests=True)
    result = epdctl("logs", "--name", "demo", "--request", given)
    assert result.exit_code == 0, result.stderr
    rows = result.stdout.splitlines()
    assert [(row.split(" | ")[0].split()[1], row.split("] ")[-1]) for row in rows[1:]] == [
        ("encode-0", "Received request chatcmpl-abc:enc0: p"),
        ("encode-0", "Added request chatcmpl-abc:enc0-8f9e7d6c."),
        ("pd-0", "Received request chatcmpl-abc: p"),
        ("pd-0", "Added request chatcmpl-abc-01234567.")]
    assert rows[0].endswith(proxy) and "abcd" not in result.stdout
    assert result.stderr == ""


def test_request_journey_without_request_logging_says_how_to_turn_it_on(epdctl,
                                                                        past_run) -> None:
    now = datetime.now()
    past_run({"proxy": [f"{now:%Y-%m-%d %H:%M:%S},500 INFO epdctl.proxy: rid=abc route=/v1/"
                        "completions status=200 total_ms=1.0"], "pd-0": ["nothing"]},
             log_requests=False)
    result = epdctl("logs", "--name", "demo", "--request", "abc")
    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) == 1
    assert "engine.log_requests: true" in result.stderr
