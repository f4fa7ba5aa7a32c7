"""The audio workload: generated clips, vLLM's custom_audio dataset, its argv and refusals."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import pytest

from epdctl.bench.arms import derive_arms
from epdctl.bench.audio import AUDIO_RATE, AUDIO_SECONDS, write_audio_dataset
from epdctl.bench.runner import prompts_for_arms
from epdctl.bench.workload import LoadPoint, Workload, argv, check
from epdctl.errors import BenchError
from epdctl.topology.model import parse_topology

AUDIO = Workload(points=(LoadPoint(), LoadPoint(max_concurrency=2)), num_prompts=3, images=0,
                 audios=1, input_len=4, output_len=5)


def topology(limits: str) -> object:
    return parse_topology({
        "name": "a", "model": "org/audio", "served_model_name": "au", "device": "cpu",
        "engine": {"args": ["--limit-mm-per-prompt", limits]},
        "roles": {"encode": {}, "prefill_decode": {}}})


def test_argv_is_vllms_custom_audio_dataset_as_chat(tmp_path: Path) -> None:
    path = tmp_path / "point-1.jsonl"
    args = argv(["b"], AUDIO, 1, url="u", model="m", served_model_name="m",
                result_dir=tmp_path, result_name="r.json", dataset=path)
    at = args.index("--dataset-name")
    assert args[at:at + 9] == ["--dataset-name", "custom_audio", "--dataset-path", str(path),
                               "--custom-output-len", "5", "--enable-multimodal-chat",
                               "--disable-shuffle", "--ignore-eos"]
    assert args[args.index("--backend") + 1] == "openai-chat"
    warm = argv(["b"], AUDIO, 0, url="u", model="m", served_model_name="m",
                result_dir=tmp_path, result_name="w.json", dataset=tmp_path / "w.jsonl",
                warmup=2)
    assert warm[warm.index("--dataset-path") + 1] == str(tmp_path / "w.jsonl")
    assert warm[warm.index("--num-prompts") + 1] == "2"
    assert AUDIO.kind == "audio" and AUDIO.as_json()["audios"] == 1


def test_the_dataset_is_one_clip_per_request_and_vllm_reads_it(tmp_path: Path) -> None:
    counts = write_audio_dataset(AUDIO, 7, 3, tmp_path / "d.jsonl")
    assert counts == {"requests": 3, "audios": 3}
    lines = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    clips = [Path(line["audio"]).read_bytes() for line in lines]
    assert len(set(clips)) == 3  # every request its own clip
    with wave.open(io.BytesIO(clips[0])) as clip:
        assert (clip.getframerate(), clip.getnchannels()) == (AUDIO_RATE, 1)
        assert clip.getnframes() == int(AUDIO_SECONDS * AUDIO_RATE)
    write_audio_dataset(AUDIO, 7, 3, tmp_path / "again.jsonl")
    assert [Path(json.loads(x)["audio"]).read_bytes() for x in
            (tmp_path / "again.jsonl").read_text().splitlines()] == clips  # same seed, same
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    pytest.importorskip("soundfile")
    pytest.importorskip("pandas")  # custom_audio reads its JSON lines with pandas

    class Tokenizer:  # what custom_audio asks of one: a length, no chat template
        chat_template = None

        def __call__(self, text: str) -> object:
            return type("Encoded", (), {"input_ids": text.split()})()

    ds = datasets.CustomAudioDataset(dataset_path=str(tmp_path / "d.jsonl"), random_seed=0,
                                     disable_shuffle=True)
    requests = ds.sample(tokenizer=Tokenizer(), num_requests=3, output_len=5,
                         enable_multimodal_chat=True)
    assert [r.prompt for r in requests] == [line["prompt"] for line in lines]
    part = requests[0].multi_modal_data
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    with wave.open(io.BytesIO(base64.b64decode(part["input_audio"]["data"]))) as sent:
        assert sent.getnframes() == int(AUDIO_SECONDS * AUDIO_RATE)


def test_refusals_before_anything_starts() -> None:
    arms = derive_arms(topology('{"audio": 1}'), Path("a.yaml"))  # type: ignore[arg-type]
    with pytest.raises(BenchError, match="give no --images or --videos with it"):
        check(arms, Workload(points=(LoadPoint(),), images=1, audios=1))
    with pytest.raises(BenchError, match="--audios 2: vLLM's custom_audio dataset sends one"):
        check(arms, Workload(points=(LoadPoint(),), images=0, audios=2))
    none = derive_arms(topology('{"audio": 0}'), Path("a.yaml"))  # type: ignore[arg-type]
    with pytest.raises(BenchError, match=r"1 audio clip\(s\) per request; `epd` accepts at "
                       r"most 0"):
        check(none, AUDIO)
    check(arms, AUDIO)


def test_an_audio_models_arms_get_the_audio_prompts_of_the_greedy_subset() -> None:
    audio = derive_arms(topology('{"audio": 1}'), Path("a.yaml"))  # type: ignore[arg-type]
    assert [p.name for p in prompts_for_arms(audio)] == [
        "text only", "one audio clip", "repeated audio clip, streamed"]
    vision = derive_arms(topology('{"image": 1}'), Path("v.yaml"))  # type: ignore[arg-type]
    names = [p.name for p in prompts_for_arms(vision)]
    assert "one image" in names and "two images" not in names
    assert not any("audio" in n or "video" in n for n in names)
