"""`epdctl verify` with fake servers: comparison, report, exit codes, what it stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epdctl.launch.plan import LaunchSpec
from epdctl.verifier import probes as core
from epdctl.verifier import prompts
from epdctl.verifier.baseline import baseline_spec
from tests.conftest import is_running, run_pids

pytestmark = pytest.mark.timeout(60)
NAMES = [p.name for p in prompts.prompts_for({"image"})]  # the fake topology: images only


def answer(text: str | None, error: str | None = None) -> core.ChatAnswer:
    return core.ChatAnswer(text, 0.25, error)


def result(mine: str | None, theirs: str | None, cache: core.CacheUse | None = None,
           prompt: core.Prompt = core.PROMPTS[1]) -> core.Result:
    return core.Result(prompt, answer(mine), answer(theirs), cache)


def test_result_is_ok_only_when_equal_and_no_image_was_encoded_twice() -> None:
    assert result("a", "a").is_ok
    assert not result("a", "b").is_ok
    assert result("a", "a", core.CacheUse(keys=2, hits=2)).is_ok
    assert result("a", "a", core.CacheUse(keys=2, hits=1)).is_ok  # one needed no encoder output
    assert not result("a", "a", core.CacheUse(keys=1, hits=0, misses=1)).is_ok
    assert not result("a", "b", core.CacheUse(keys=1, hits=1)).is_ok
    failed = core.Result(core.PROMPTS[0], answer(None, "HTTP 500: boom"), answer(None, "x"))
    assert not failed.is_equal  # two errors are not "equal" answers


@pytest.mark.parametrize(("hits", "misses", "verdict"), [
    (2, 0, "hit"), (1, 0, "partial"), (0, 0, "unused"), (1, 1, "miss"), (0, 2, "miss")])
def test_cache_verdicts(hits: int, misses: int, verdict: str) -> None:
    assert core.CacheUse(keys=2, hits=hits, misses=misses).verdict == verdict


def test_passing_needs_one_real_hit_when_there_is_an_encoder() -> None:
    unused = core.CacheUse(keys=1, hits=0)
    assert not core.is_passed([result("a", "a", unused), result("b", "b", unused)])
    assert core.is_passed([result("a", "a", unused), result("b", "b", core.CacheUse(1, 1))])
    assert core.is_passed([result("a", "a")])  # no encoder: nothing to load
    assert not core.is_passed([])


def test_prompts_cover_the_cases_and_their_images_differ() -> None:
    images = {p.name: p.images for p in core.PROMPTS}
    assert images["text only"] == ()
    assert len(set(images["two images"])) == 2
    assert len(images["same image twice"]) == 2 and len(set(images["same image twice"])) == 1
    assert images["repeated image"] == images["one image"]
    assert any(p.is_streamed for p in core.PROMPTS)
    pngs = {prompts.png(seed) for p in core.PROMPTS for seed in p.images}
    assert len(pngs) == len({seed for p in core.PROMPTS for seed in p.images})
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in pngs)


def test_prompts_cover_every_modality_and_only_the_ones_taken() -> None:
    assert prompts.taken_modalities(["--limit-mm-per-prompt", '{"image": 2, "video": 1}']) == {
        "image", "video"}
    assert prompts.taken_modalities(["--limit-mm-per-prompt", '{"audio": 2, "image": 0}']) == {
        "audio"}
    assert prompts.taken_modalities([]) == {"image"}
    for taken in ({"image"}, {"image", "video"}, {"audio"}):
        chosen = prompts.prompts_for(taken)
        assert {m for p in chosen for m in p.modalities} == taken
        assert chosen[0].name == "text only"
    every = prompts.prompts_for({"image", "video", "audio"})
    assert every == core.PROMPTS
    assert any(len(p.modalities) == 2 for p in every)  # an image with a video


def test_media_keys_are_the_keys_the_proxy_gives() -> None:
    """verify's own keys for its prompts' media equal the proxy's content keys, per modality
    (the store check counts loads of exactly these)."""
    import asyncio

    from epdctl.proxy.request.media import assign_uuids
    from epdctl.proxy.request.parse import find_media

    for prompt in core.PROMPTS:
        items = find_media(core.chat_body(prompt, "m"))
        asyncio.run(assign_uuids(items, None, 1.0, 1 << 20))  # type: ignore[arg-type]
        assert {i.uuid for i in items} == core.media_keys(prompt), prompt.name
        assert [i.modality for i in items] == (
            ["image"] * len(prompt.images) + ["video"] * len(prompt.videos)
            + ["audio"] * len(prompt.audios))
    assert prompts.wav(1) != prompts.wav(2) and prompts.wav(1).startswith(b"RIFF")
    assert core.media_keys(core.PROMPTS[6]) != core.media_keys(core.PROMPTS[7])


def test_chat_body_salts_every_request() -> None:
    a, b = (core.chat_body(core.PROMPTS[3], "m") for _ in range(2))
    assert a["cache_salt"] != b["cache_salt"] and a["temperature"] == 0.0
    parts = a["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert "stream" not in a and core.chat_body(core.PROMPTS[5], "m")["stream"] is True


def write_stats(ns_dir: Path, writer: str, key_hits: dict[str, int], **counts: int) -> None:
    from epdctl.cache.store import STATS

    (ns_dir / STATS).mkdir(parents=True, exist_ok=True)
    body = {"counts": counts, "key_hits": key_hits, "updated": 0}
    (ns_dir / STATS / f"{writer}.json").write_text(json.dumps(body))


def test_cache_use_counts_key_hits_since_before(tmp_path: Path) -> None:
    write_stats(tmp_path, "pd-0-scheduler", {"k1": 1}, hits=1)
    before = core.StoreCounters.read(tmp_path)
    write_stats(tmp_path, "pd-0-scheduler", {"k1": 2, "k2": 1}, hits=3)
    use = core.cache_use(tmp_path, before, {"k1", "k2"}, timeout_s=0)
    assert use == core.CacheUse(keys=2, hits=2, misses=0)


def test_cache_use_gives_up_at_the_deadline(tmp_path: Path) -> None:
    before = core.StoreCounters.read(tmp_path)
    write_stats(tmp_path, "pd-0-scheduler", {"other": 1}, hits=1, misses=1)
    now = iter([0.0, 0.0, 10.0])
    use = core.cache_use(tmp_path, before, {"k1"}, clock=lambda: next(now), sleep=lambda s: None)
    assert use == core.CacheUse(keys=1, hits=0, misses=1)


def test_baseline_spec_drops_transfer_configs_and_side_channel() -> None:
    spec = LaunchSpec(
        name="prefill-0", role="prefill",
        command=("vllm", "serve", "m"), args=("--dtype", "float32"), ec_config={},
        kv_config={}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "CUDA_VISIBLE_DEVICES": "1",
                           "X": "y"},
        port=8101, log_path=Path("/x.log"), gpus=("1",), side_channel_port=5600,
    )
    twin = baseline_spec(spec, 9000, Path("/b.log"), ["3"])
    assert twin.argv == ("vllm", "serve", "m", "--host", "127.0.0.1", "--port", "9000",
                         "--dtype", "float32")
    assert twin.env == {"CUDA_VISIBLE_DEVICES": "3", "X": "y"}
    assert (twin.name, twin.port, twin.gpus, twin.side_channel_port) == (
        "verify-baseline", 9000, ("3",), None)
    assert twin.health_url == "http://127.0.0.1:9000/health"


def test_report_document_shape() -> None:
    rows = [result("a", "a", prompt=core.PROMPTS[0]),
            result("a", "b", core.CacheUse(keys=1, hits=1))]
    doc = core.report(rows, name="t")
    assert doc["ok"] is False and doc["name"] == "t"
    assert [(p["videos"], p["audios"]) for p in doc["prompts"]] == [(0, 0), (0, 0)]
    for row in doc["prompts"]:
        del row["videos"], row["audios"]
    assert doc["prompts"][1] == {
        "name": "one image", "images": 1, "stream": False, "equal": False, "ok": False,
        "cache": {"verdict": "hit", "keys": 1, "hits": 1, "misses": 0},
        "topology": {"text": "a", "latency_s": 0.25, "error": None},
        "baseline": {"text": "b", "latency_s": 0.25, "error": None},
    }
    assert core.report([])["ok"] is False


@pytest.fixture
def hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake engines write no EC stats: every image counts as loaded from the store."""
    monkeypatch.setattr(core, "cache_use",
                        lambda ns_dir, before, keys: core.CacheUse(len(keys), len(keys)))


def differ_on(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The baseline answers prompt `name` (its text is unique) differently."""
    text = next(p.text for p in core.PROMPTS if p.name == name)
    real, seen = core.send_chat, []

    def send(url, body, headers):
        got = real(url, body, headers)
        content = body["messages"][0]["content"]
        if (content if isinstance(content, str) else content[-1]["text"]) == text:
            seen.append(url)
            if len(seen) == 2:  # run_prompts asks the topology first, then the baseline
                return core.ChatAnswer("something else", got.latency_s)
        return got

    monkeypatch.setattr(core, "send_chat", send)


def recorded_alive(state_root: Path, doc: dict) -> list[int]:
    pids = [*run_pids(state_root).values(), doc["baseline"]["pid"]]
    return [pid for pid in pids if pid and is_running(pid)]


def test_verify_brings_up_compares_and_stops_everything(epdctl, fake_topology, state_root,
                                                        hits) -> None:
    result = epdctl("verify", str(fake_topology()), "--json", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {"name", "mode", "model", "ec_connector", "cache_check", "proxy_url",
                        "started_topology", "kept", "baseline", "ok", "prompts"}
    assert (doc["ec_connector"], doc["cache_check"]) == ("EpdctlShmECConnector", "store")
    assert (doc["name"], doc["mode"], doc["ok"], doc["started_topology"]) == (
        "fake", "e-pd", True, True)
    assert doc["baseline"]["model"] == "fake-model"
    assert Path(doc["baseline"]["log"]) == state_root / "fake" / "logs" / "verify-baseline.log"
    assert [p["name"] for p in doc["prompts"]] == NAMES
    assert all(p["topology"]["text"].strip() == "hello from fake" for p in doc["prompts"])
    assert [p["cache"] is None for p in doc["prompts"]] == [True] + [False] * 5
    assert recorded_alive(state_root, doc) == []
    assert not (state_root / "fake" / "state.json").exists()
    assert "Starting the baseline on port " in result.stderr
    assert "Stopping fake (verify started it; --keep leaves it running)" in result.stderr


def test_a_mismatch_exits_1_with_a_table(epdctl, fake_topology, state_root, hits,
                                         monkeypatch) -> None:
    differ_on(monkeypatch, "two images")
    result = epdctl("verify", str(fake_topology()), "--timeout", "20")
    assert result.exit_code == 1
    assert result.stderr.endswith("Error: 1 of 6 prompts failed: two images\n")
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["PROMPT", "OUTPUT", "EC", "CACHE", "TOPOLOGY", "BASELINE"]
    assert lines[3].split()[:5] == ["two", "images", "DIFFERENT", "hit", "2/2"]
    assert lines[1].split()[:4] == ["text", "only", "equal", "-"]
    assert "two images: baseline 'something else'" in result.stdout
    assert not (state_root / "fake" / "state.json").exists()


def test_no_hit_at_all_exits_1(epdctl, fake_topology, monkeypatch) -> None:
    """Fake engines never use the store: every image 'unused', which cannot pass."""
    monkeypatch.setattr(core, "cache_use", lambda ns_dir, before, keys: core.CacheUse(
        len(keys), 0))
    result = epdctl("verify", str(fake_topology()), "--timeout", "20")
    assert result.exit_code == 1
    assert "Error: no image was loaded from the EC store" in result.stderr
    assert result.stdout.splitlines()[2].split()[2:5] == ["equal", "unused", "0/1"]


def test_a_cache_miss_exits_1(epdctl, fake_topology, monkeypatch) -> None:
    monkeypatch.setattr(core, "cache_use", lambda ns_dir, before, keys: core.CacheUse(
        len(keys), 0, misses=1))
    result = epdctl("verify", str(fake_topology()), "--json", "--timeout", "20")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and all(p["equal"] for p in doc["prompts"])
    assert [p["ok"] for p in doc["prompts"]] == [True] + [False] * 5


def test_a_running_topology_is_used_and_left_running(epdctl, fake_topology, state_root,
                                                     hits) -> None:
    topo = fake_topology()
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    pids = run_pids(state_root)
    result = epdctl("verify", str(topo), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["started_topology"] is False and doc["kept"] is False
    assert "fake is running already: verifying it" in result.stderr
    assert all(is_running(pid) for pid in pids.values())
    assert not is_running(doc["baseline"]["pid"])
    assert epdctl("down").exit_code == 0


def test_keep_leaves_the_topology_it_started(epdctl, fake_topology, state_root, hits) -> None:
    result = epdctl("verify", str(fake_topology()), "--json", "--keep", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["started_topology"] is True and doc["kept"] is True
    assert all(is_running(pid) for pid in run_pids(state_root).values())
    assert not is_running(doc["baseline"]["pid"])
    assert epdctl("down").exit_code == 0


def test_baseline_url_is_used_and_nothing_is_started_for_it(epdctl, fake_topology, state_root,
                                                            hits) -> None:
    topo = fake_topology()
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    proxy = json.loads(epdctl("status", "--json").stdout)["proxy_url"]
    result = epdctl("verify", str(topo), "--json", "--baseline-url", proxy)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["baseline"] == {"url": proxy, "model": "fake-model", "pid": None, "log": None}
    assert not (state_root / "fake" / "logs" / "verify-baseline.log").exists()
    assert epdctl("down").exit_code == 0


def test_unreachable_baseline_url_fails_before_starting(epdctl, fake_topology,
                                                        state_root) -> None:
    result = epdctl("verify", str(fake_topology()), "--baseline-url", "http://127.0.0.1:9")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot list the models of http://127.0.0.1:9: ")
    assert not (state_root / "fake").exists()


def test_a_missing_local_model_is_refused_before_anything_starts(epdctl, fake_topology,
                                                                  state_root, tmp_path) -> None:
    topo = fake_topology()
    topo.write_text(topo.read_text().replace("model: fake-model", "model: ./no-model"))
    result = epdctl("verify", str(topo))
    assert result.exit_code == 1
    assert result.stderr == (f"Error: `fake`: model path {tmp_path / 'no-model'} does not exist; "
                             "put the model there, or name a Hugging Face id\n")
    assert not (state_root / "fake").exists()


def test_cuda_needs_a_baseline(epdctl, tmp_path, state_root) -> None:
    topo = tmp_path / "gpu.yaml"
    topo.write_text("name: gpu\nmodel: some/model\nroles:\n  encode: {gpus: [0]}\n"
                    "  prefill_decode: {gpus: [1]}\n")
    result = epdctl("verify", str(topo))
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "Error: on `device: cuda` verify needs --baseline-url URL")
    assert not (state_root / "gpu").exists()


def test_a_running_topology_that_is_not_ready_is_refused(epdctl, fake_topology, state_root,
                                                         monkeypatch) -> None:
    from epdctl.launch import readiness

    topo = fake_topology()
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    monkeypatch.setattr(readiness, "probe", lambda url, timeout_s=1.0: 503)
    result = epdctl("verify", str(topo))
    assert result.exit_code == 1
    assert result.stderr == ("Error: `fake` is running but not ready (encode-0, pd-0, proxy); "
                             "see `epdctl status --name fake`\n")
    assert not (state_root / "fake" / "logs" / "verify-baseline.log").exists()
    monkeypatch.undo()
    assert epdctl("down").exit_code == 0
