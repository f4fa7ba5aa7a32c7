"""What tune knows of the model before measuring: heads, weight and KV sizes, image tokens.

From the model's config.json and weight files when it is a local directory, else from a
facts file (the `model:` section of any YAML, e.g. a simulated machine's cost model: the
part a config.json would tell), else defaults that the caller must say it assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epdctl.errors import TopologyError
from epdctl.topology.sections import parse_size

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


@dataclass(frozen=True)
class ModelFacts:
    heads: int | None = None
    """Attention heads (None: unknown, every TP size is tried)."""
    weights: int = 0
    """Language-model weights in bytes."""
    encoder_weights: int = 0
    kv_per_token: int = 0
    """KV cache bytes per token of context (0: unknown, KV is not checked)."""
    image_tokens_per_mpixel: float = 1275.0
    source: str = "defaults"


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def from_config(model_dir: Path) -> ModelFacts | None:
    """Facts of a local model directory (None when it has no readable config.json)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = _text_config(config)
    heads = text.get("num_attention_heads")
    layers = text.get("num_hidden_layers") or 0
    hidden = text.get("hidden_size") or 0
    kv_heads = text.get("num_key_value_heads") or heads or 0
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    width = _DTYPE_BYTES.get(dtype, 2)
    head_dim = text.get("head_dim") or (hidden // heads if heads else 0)
    total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) \
        else {}
    v_hidden = vision.get("hidden_size") or 0
    v_layers = vision.get("depth") or vision.get("num_hidden_layers") or 0
    encoder = min(12 * v_hidden * v_hidden * v_layers * width, total)
    return ModelFacts(
        heads=heads if isinstance(heads, int) and heads > 0 else None,
        weights=max(total - encoder, 0), encoder_weights=encoder,
        kv_per_token=2 * layers * kv_heads * head_dim * width,
        source=f"{model_dir / 'config.json'}")


def from_file(path: Path) -> ModelFacts:
    """The `model:` section of a YAML file (a cost model's, or one of its own)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"{path}: cannot read model facts: {exc}") from None
    section = data.get("model") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise TopologyError(f"{path}: no `model:` section (heads, weights, kv_per_token, ...)")
    try:
        facts = ModelFacts(source=str(path))
        updates: dict[str, Any] = {}
        if "heads" in section:
            updates["heads"] = int(section["heads"])
        for key in ("weights", "encoder_weights", "kv_per_token"):
            if key in section:
                updates[key] = parse_size(section[key])
        if "image_tokens_per_mpixel" in section:
            updates["image_tokens_per_mpixel"] = float(section["image_tokens_per_mpixel"])
    except (TypeError, ValueError) as exc:
        raise TopologyError(f"{path}: model: {exc}") from None
    return replace(facts, **updates)


def model_facts(model: str, facts_file: Path | None = None) -> ModelFacts:
    """A facts file wins; else a local model's config; else defaults."""
    if facts_file is not None:
        return from_file(facts_file)
    path = Path(model).expanduser()
    if path.is_absolute() and path.is_dir():
        found = from_config(path)
        if found is not None:
            return found
    return ModelFacts()
