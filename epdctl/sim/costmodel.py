"""The cost-model file of the simulated machine: what each step of each role costs.

Times are milliseconds of a fake GPU. `model` holds facts a real deployment also knows
(heads, sizes: what config.json tells); every other section is the machine's secret, which
`tune` must learn from profiles and never read. The format is documented in docs/tune.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from epdctl.errors import TopologyError
from epdctl.topology.sections import parse_size

_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
Ms = Annotated[float, Field(ge=0)]
Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]


class ModelFacts(BaseModel):
    """What the model is (a config.json would tell): `tune` may read these."""

    model_config = _CONFIG

    heads: Annotated[int, Field(ge=1)] = 32
    """Attention heads: a tensor-parallel size must divide them."""
    weights: Size = 16 << 30
    """Language-model weights, split over the TP ranks."""
    encoder_weights: Size = 1 << 30
    """Vision-encoder weights (E; P and PD hold them too)."""
    kv_per_token: Size = 512 << 10
    """KV cache per token of context, over all ranks."""
    image_tokens_per_mpixel: Annotated[float, Field(gt=0)] = 1275.0
    """Prompt tokens one megapixel of image becomes (Qwen2.5-VL: 28x28 pixels a token)."""
    chars_per_token: Annotated[float, Field(gt=0)] = 4.0
    """Prompt text characters per token."""


class Gpu(BaseModel):
    model_config = _CONFIG

    memory: Size = 80 << 30
    """Memory of each fake GPU."""


class Sharing(BaseModel):
    model_config = _CONFIG

    slowdown: Annotated[float, Field(ge=0)] = 0.5
    """Each other instance busy on the same fake GPU when a step starts makes it this much
    longer (0.5: one busy neighbour, 1.5x)."""


class TensorParallel(BaseModel):
    model_config = _CONFIG

    efficiency: Annotated[float, Field(gt=0, le=1)] = 0.85
    """TP n runs a step n * efficiency^log2(n) times faster (0.85: TP2 1.7x, TP4 2.9x)."""


class Encode(BaseModel):
    """One encoder step over a batch of images: fixed + per image (+ per megapixel)."""

    model_config = _CONFIG

    fixed_ms: Ms = 4.0
    per_image_ms: Ms = 2.0
    per_mpixel_ms: Ms = 40.0
    max_batch: Annotated[int, Field(ge=1)] = 16
    """Images one step takes at most."""


class Prefill(BaseModel):
    """One prefill step over a batch of prompts (or chunks of them): fixed + per token +
    per token squared."""

    model_config = _CONFIG

    fixed_ms: Ms = 8.0
    per_token_ms: Ms = 0.04
    per_ktoken2_ms: Ms = 2.0
    """Per request: this many ms times (its tokens / 1000)^2 (attention)."""
    max_batch_tokens: Annotated[int, Field(ge=1)] = 8192
    """Prompt tokens one step takes at most (a longer prompt runs alone); unused when
    `chunk_tokens` is set."""
    chunk_tokens: Annotated[int, Field(ge=1)] | None = None
    """Chunked prefill (vLLM's): a step prefills at most this many prompt tokens in all,
    a longer prompt over several steps (its first token comes with its last chunk); a
    chunk of c tokens after s already prefilled costs per_token_ms * c + per_ktoken2_ms *
    (((s + c) / 1000)^2 - (s / 1000)^2), so a whole prompt costs what it does unchunked
    (plus each step's fixed cost). None: a prompt is prefilled whole in one step."""


class Decode(BaseModel):
    """One decode step (a token for each running request): fixed + per request + per
    thousand tokens of context over the batch."""

    model_config = _CONFIG

    fixed_ms: Ms = 12.0
    per_seq_ms: Ms = 0.25
    per_kctx_ms: Ms = 0.08
    max_batch: Annotated[int, Field(ge=1)] = 256
    """Requests decoding at once at most (vLLM's --max-num-seqs caps it further)."""
    batch_exponent: Annotated[float, Field(ge=1)] = 1.0
    """The per-request term is per_seq_ms * batch^batch_exponent (above 1: a step that
    grows faster than the batch, as one past the GPU's sweet spot does)."""


class KvTransfer(BaseModel):
    model_config = _CONFIG

    per_ktoken_ms: Ms = 1.0
    """D pulling P's KV, per thousand prompt tokens (not batched)."""


class CostModel(BaseModel):
    """A simulated machine: its GPUs and what each role's steps cost on them."""

    model_config = _CONFIG

    name: str = "cost-model"
    time_scale: Annotated[float, Field(gt=0)] = 1.0
    """Every wait is multiplied by it (0.1: ten times faster than the figures say)."""
    startup_s: Annotated[float, Field(ge=0)] = 0.0
    """Seconds (unscaled) before /health answers 200."""
    utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of a GPU an instance takes without --gpu-memory-utilization."""
    model: ModelFacts = ModelFacts()
    gpu: Gpu = Gpu()
    sharing: Sharing = Sharing()
    tensor_parallel: TensorParallel = TensorParallel()
    encode: Encode = Encode()
    prefill: Prefill = Prefill()
    decode: Decode = Decode()
    kv_transfer: KvTransfer = KvTransfer()

    def speedup(self, tp: int) -> float:
        return tp * self.tensor_parallel.efficiency ** math.log2(tp) if tp > 1 else 1.0

    def encode_ms(self, mpixels: Sequence[float]) -> float:
        """One encoder step over these images (megapixels each); 0 for none."""
        if not mpixels:
            return 0.0
        e = self.encode
        return e.fixed_ms + sum(e.per_image_ms + e.per_mpixel_ms * mp for mp in mpixels)

    def prefill_ms(self, tokens: Sequence[int], starts: Sequence[int] = ()) -> float:
        """One prefill step over these prompts or chunks (tokens each, the i-th after
        starts[i] tokens of its prompt already prefilled: 0 where not given); 0 for none."""
        if not tokens:
            return 0.0
        p = self.prefill
        before = [*starts, *[0] * (len(tokens) - len(starts))]
        # A chunk's attention is its tokens over the context so far: the growth of the
        # square, so chunks add up to the whole prompt's (n / 1000)^2 exactly.
        return p.fixed_ms + sum(
            p.per_token_ms * n + p.per_ktoken2_ms * (((s + n) / 1000) ** 2 - (s / 1000) ** 2)
            for n, s in zip(tokens, before, strict=True))

    def decode_ms(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests with `context` tokens among them; 0 for none."""
        if batch <= 0:
            return 0.0
        d = self.decode
        return (d.fixed_ms + d.per_seq_ms * batch ** d.batch_exponent
                + d.per_kctx_ms * context / 1000)

    def step_ms(self, *, mpixels: Sequence[float] = (), tokens: Sequence[int] = (),
                starts: Sequence[int] = (), batch: int = 0, context: int = 0, tp: int = 1,
                busy_neighbours: int = 0) -> float:
        """A whole step of one instance, in unscaled ms: the parts it runs share one fixed
        cost (the largest), divided by the TP speedup, stretched by busy neighbours.
        `tokens`/`starts`: the prompts or chunks it prefills (prefill_ms)."""
        parts = [(self.encode_ms(mpixels), self.encode.fixed_ms if mpixels else 0.0),
                 (self.prefill_ms(tokens, starts), self.prefill.fixed_ms if tokens else 0.0),
                 (self.decode_ms(batch, context), self.decode.fixed_ms if batch else 0.0)]
        total = sum(ms for ms, _ in parts) - sum(f for _, f in parts) + max(f for _, f in parts)
        return total / self.speedup(tp) * (1 + self.sharing.slowdown * busy_neighbours)

    def weights_bytes(self, role: str) -> int:
        """What one instance of the role holds in weights, over all its ranks."""
        if role == "encode":
            return self.model.encoder_weights
        extra = self.model.encoder_weights if role in ("prefill_decode", "prefill") else 0
        return self.model.weights + extra


def load_cost_model(path: str | Path) -> CostModel:
    """Read and validate a cost-model YAML file; TopologyError with one line per problem."""
    import yaml

    path = Path(path)
    try:
        data: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"{path}: cannot read the cost model: {exc}") from None
    try:
        return CostModel.model_validate(data or {})
    except ValidationError as exc:
        lines = [f"{' -> '.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}"
                 for e in exc.errors()]
        raise TopologyError(f"{path}: invalid cost model:\n" + "\n".join(lines)) from None
