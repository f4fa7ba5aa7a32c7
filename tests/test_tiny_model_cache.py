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


def test_each_models_template_places_the_modalities_it_takes() -> None:
    """The shared template: each model's placeholder where its parts are, nothing for a
    modality it does not take (vLLM refuses those parts before the template)."""
    from jinja2 import Template

    from epdctl.dev.tiny_models import chat_template

    parts = [{"type": "video_url"}, {"type": "text", "text": "hi"}, {"type": "input_audio"},
             {"type": "image_url"}, {"type": "audio_url"}]
    messages = [{"role": "user", "content": parts}]
    text = Template(chat_template(image="<I>", video="<V>", audio="<A>")).render(
        messages=messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<V>hi<A><I><A><|im_end|>\n<|im_start|>assistant\n"
    only_images = Template(chat_template(image="<I>")).render(messages=messages)
    assert only_images == "<|im_start|>user\nhi<I><|im_end|>\n"


def test_audio_weights_are_named_as_vllms_loader_wants() -> None:
    from epdctl.dev.tiny_models import audio_weight_name

    assert audio_weight_name("model.audio_tower.conv1.weight") == "audio_tower.conv1.weight"
    assert audio_weight_name("model.multi_modal_projector.linear.bias") == (
        "multi_modal_projector.linear.bias")
    assert audio_weight_name("model.language_model.layers.0.mlp.up_proj.weight") == (
        "language_model.model.layers.0.mlp.up_proj.weight")
    assert audio_weight_name("lm_head.weight") == "language_model.lm_head.weight"
