"""The tiny models' shared tokenizer (a byte-level BPE trained in-process on a deterministic
pseudo-English corpus) and their ChatML template."""

from __future__ import annotations

import random
from typing import Any

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>")

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


def _corpus(seed: int) -> list[str]:
    """A deterministic pseudo-English corpus, enough for ~750 BPE merges."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    words = list(_WORDS) + ["".join(rng.choices(syllables, k=rng.randint(1, 3)))
                            for _ in range(600)]
    lines = []
    for _ in range(3000):
        line = " ".join(rng.choices(words, k=rng.randint(4, 14)))
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    lines += [str(n) for n in range(200)]
    return lines


def _train_tokenizer(extra_special: tuple[str, ...], seed: int) -> Any:
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
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tok


def hf_tokenizer(extra_special: tuple[str, ...], seed: int) -> Any:
    """The tokenizer as transformers saves it, with SPECIAL_TOKENS and `extra_special`
    first; `seed` draws its training corpus."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(extra_special, seed),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )
