"""The three tiny models' recipes: each builds its config, weights and processor into a
directory (tiny_models caches the builds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epdctl.dev._tokenizer import VOCAB_SIZE, chat_template, hf_tokenizer
from epdctl.dev._weights import init_weights, make_decisive

SEED = 1234
QWEN_VISION_TOKENS = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN_AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
LLAVA_IMAGE_SIZE = 56
QWEN_MAX_SIDE = 112
PATCH = 14


def _save_weights(model: Any, out: Path, rename: Callable[[str], str] = lambda k: k) -> None:
    from safetensors.torch import save_file

    state = {rename(k): v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _write_config(config: Any, out: Path, architecture: str) -> None:
    # vLLM resolves the architecture from this list (without it: a pooling model).
    config.architectures = [architecture]
    config.save_pretrained(str(out))
    gen = {"bos_token_id": config.text_config.bos_token_id,
           "eos_token_id": config.text_config.eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def llava(out: Path) -> None:
    """Build the tiny LLaVA into `out`."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = hf_tokenizer((), SEED)
    ids = tokenizer.convert_tokens_to_ids
    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=LLAVA_IMAGE_SIZE, patch_size=PATCH, projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=1024, bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        projector_hidden_act="gelu", tie_word_embeddings=False,
    )
    config.dtype = torch.float32
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).float()
    init_weights(model, SEED)
    make_decisive(model, tokenizer, SEED)
    _write_config(config, out, "LlavaForConditionalGeneration")
    # transformers 5 writes vision_tower.embeddings.*; vLLM's loader wants vision_model.*.
    _save_weights(model, out, lambda k: k.replace("vision_tower.", "vision_tower.vision_model.")
                  if "vision_tower." in k and "vision_model." not in k else k)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chat_template(image="<image>"),
    )
    processor.save_pretrained(str(out))


def qwen2vl(out: Path) -> None:
    """Build the tiny Qwen2-VL into `out`."""
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = hf_tokenizer(QWEN_VISION_TOKENS, SEED)
    ids = tokenizer.convert_tokens_to_ids
    pixels = {"shortest_edge": 56 * 56, "longest_edge": QWEN_MAX_SIDE * QWEN_MAX_SIDE}
    config = Qwen2VLConfig(
        vision_config={
            "depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
            "patch_size": PATCH, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        text_config={
            "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 1024, "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [8, 12, 12]},
        },
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False,
    )
    config.dtype = torch.float32
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).float()
    init_weights(model, SEED)
    make_decisive(model, tokenizer, SEED)
    _write_config(config, out, "Qwen2VLForConditionalGeneration")
    _save_weights(model, out)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixels),
        video_processor=Qwen2VLVideoProcessor(size=pixels),
        tokenizer=tokenizer,
        chat_template=chat_template(
            image="<|vision_start|><|image_pad|><|vision_end|>",
            video="<|vision_start|><|video_pad|><|vision_end|>"),
    )
    processor.save_pretrained(str(out))


def audio_weight_name(key: str) -> str:
    """transformers 5's `model.audio_tower.*` / `model.language_model.*` / `lm_head.*` as
    vLLM's Qwen2-Audio loader names them (it has no mapper): `audio_tower.*`,
    `language_model.model.*`, `language_model.lm_head.*`."""
    for old, new in (("model.language_model.", "language_model.model."),
                     ("model.", ""), ("lm_head.", "language_model.lm_head.")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


def qwen2audio(out: Path) -> None:
    """Build the tiny Qwen2-Audio into `out`."""
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = hf_tokenizer(QWEN_AUDIO_TOKENS, SEED)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2AudioConfig(
        audio_config={
            "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128, "num_mel_bins": 128, "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2", "vocab_size": VOCAB_SIZE, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 2048,
            "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
            "tie_word_embeddings": False,
        },
        audio_token_index=ids("<|AUDIO|>"),
    )
    config.dtype = torch.float32
    torch.manual_seed(SEED)
    model = Qwen2AudioForConditionalGeneration(config).float()
    init_weights(model, SEED)
    make_decisive(model, tokenizer, SEED)
    _write_config(config, out, "Qwen2AudioForConditionalGeneration")
    _save_weights(model, out, audio_weight_name)
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=chat_template(audio="<|audio_bos|><|AUDIO|><|audio_eos|>"),
    )
    processor.save_pretrained(str(out))


BUILDERS: dict[str, Callable[[Path], None]] = {
    "llava": llava, "qwen2vl": qwen2vl, "qwen2audio": qwen2audio}
