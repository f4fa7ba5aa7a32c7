"""Random simulated machines: cost models drawn from ranges, to show `tune` machines it has
never seen.

`draw(seed)` is deterministic per seed: every field of RANGES is drawn from its range (one
`random.Random(seed)` draws them in RANGES' order), and a machine that the benchmark workload
could not be served on, or whose best knee is far outside what a sweep measures, is thrown
away and drawn again from the same generator (servability). `write` dumps one as a cost-model
YAML that `load_cost_model` reads back equal. docs/tune.md "Random machines" has the table.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdctl.sim.costmodel import CostModel

GIB, KIB = 1 << 30, 1 << 10
TIME_SCALE = 4.0
"""As examples/sim/*.yaml: the SLO below is in real ms, the cost model's ms times this."""
GPU_MEMORY = 80 * GIB
REFERENCE_GPUS = 4
"""The knee bounds are for this many fake GPUs (benchmarks/tune.py's REFERENCE_GPUS)."""
IMAGES, IMAGE_SIZE, INPUT_LEN, OUTPUT_LEN = 1, (512, 512), 64, 32
"""benchmarks/tune.py's workload: a request's images, their size, text and output tokens."""
SLO_MS = {"ttft": 3000.0, "tpot": 60.0}
"""benchmarks/tune.py's SLO (real ms, on REFERENCE_GPUS)."""
SLO_SHARE = 0.85
"""At a trickle, TTFT and TPOT of the aggregated 1-GPU candidate are at most this share of
the SLO: a machine whose simplest deployment barely holds it alone has no knee to find."""
KNEE_RANGE = (0.5, 60.0)
"""req/s on REFERENCE_GPUS: the lowest and highest rate a sweep can place a knee at (its
ladder's foot; what two cores of proxy and load generator carry). A machine's knee bounds
(knee_bounds) must overlap it."""
MAX_TRIES = 1000


@dataclass(frozen=True)
class Range:
    """How one field is drawn: uniform in [low, high] (of the log where `is_log`); rounded
    where `is_int`; one of `choices` where given; `none_share` of machines get None (the
    field's "off") and `low_share` exactly `low` instead."""

    low: float
    high: float
    is_log: bool = False
    is_int: bool = False
    choices: tuple[int, ...] = ()
    none_share: float = 0.0
    low_share: float = 0.0

    def draw(self, rng: random.Random) -> float | int | None:
        # Every branch takes the same draws, so that a range's shares do not shift the
        # fields after it.
        gate, u = rng.random(), rng.random()
        if self.choices:
            return self.choices[min(int(u * len(self.choices)), len(self.choices) - 1)]
        if gate < self.none_share:
            return None
        if gate < self.none_share + self.low_share:
            return int(self.low) if self.is_int else self.low
        if self.is_log:
            value = math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        else:
            value = self.low + u * (self.high - self.low)
        return min(max(round(value), int(self.low)), int(self.high)) if self.is_int else value


RANGES: dict[str, Range] = {
    "encode.fixed_ms": Range(1.0, 12.0, is_log=True),
    "encode.per_image_ms": Range(0.5, 8.0, is_log=True),
    "encode.per_mpixel_ms": Range(5.0, 400.0, is_log=True),
    "encode.max_batch": Range(4, 32, is_log=True, is_int=True),
    "prefill.fixed_ms": Range(3.0, 20.0, is_log=True),
    "prefill.per_token_ms": Range(0.005, 0.15, is_log=True),
    "prefill.per_ktoken2_ms": Range(0.2, 40.0, is_log=True),
    "prefill.max_batch_tokens": Range(2048, 16384, is_log=True, is_int=True),
    "prefill.chunk_tokens": Range(512, 2048, is_log=True, is_int=True, none_share=0.5),
    "decode.fixed_ms": Range(3.0, 24.0, is_log=True),
    "decode.per_seq_ms": Range(0.05, 2.0, is_log=True),
    "decode.per_kctx_ms": Range(0.01, 0.3, is_log=True),
    "decode.batch_exponent": Range(1.0, 1.6, low_share=0.4),
    "decode.max_batch": Range(64, 512, is_log=True, is_int=True),
    "kv_transfer.per_ktoken_ms": Range(0.2, 4.0, is_log=True),
    "sharing.slowdown": Range(0.1, 1.5),
    "tensor_parallel.efficiency": Range(0.7, 0.95),
    "model.heads": Range(16, 40, choices=(16, 28, 32, 40)),
    "model.weights": Range(4 * GIB, 40 * GIB, is_log=True, is_int=True),
    "model.encoder_weights": Range(GIB // 2, 3 * GIB, is_log=True, is_int=True),
    "model.kv_per_token": Range(64 * KIB, 640 * KIB, is_log=True, is_int=True),
}
"""Each drawn field (`section.key` of the cost model) and its range; the rest is fixed:
time_scale TIME_SCALE, GPU memory GPU_MEMORY, the model's image and text token rates as the
defaults. The examples' values lie within (but for decode-heavy's 18 ms decode step, which
needs TP2 to hold the TPOT: servability keeps such machines)."""


def _fields(rng: random.Random) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, spec in RANGES.items():
        section, field = key.split(".")
        data.setdefault(section, {})[field] = spec.draw(rng)
    return data


def draw(seed: int) -> CostModel:
    """The random machine of `seed`: the first servable draw of random.Random(seed)."""
    rng = random.Random(seed)
    for _ in range(MAX_TRIES):
        model = CostModel.model_validate({
            "name": f"random-{seed}", "time_scale": TIME_SCALE,
            "gpu": {"memory": GPU_MEMORY}, **_fields(rng)})
        if servability(model) is None:
            return model
    raise RuntimeError(f"no servable machine in {MAX_TRIES} draws of seed {seed}")


def _request(model: CostModel) -> tuple[float, int, int]:
    """The workload's request on `model`: megapixels of its image, prompt tokens, context
    at its last token (as the fake engine counts them, epdctl.sim.requests)."""
    mpixels = IMAGE_SIZE[0] * IMAGE_SIZE[1] / 1e6
    prompt = INPUT_LEN + round(IMAGES * mpixels * model.model.image_tokens_per_mpixel)
    return mpixels, prompt, prompt + OUTPUT_LEN


def knee_bounds(model: CostModel) -> tuple[float, float]:
    """Rough bounds (req/s) of the best knee on REFERENCE_GPUS: low, every GPU an aggregated
    instance serving one request at a time (batching only does better); high, every GPU
    busy with nothing but each request's own work (no fixed costs: perfect batching, which
    no candidate beats, TP and sharing only lose)."""
    mpixels, prompt, context = _request(model)
    out = OUTPUT_LEN
    alone_ms = (model.step_ms(mpixels=[mpixels] * IMAGES, tokens=[prompt])
                + (out - 1) * model.decode_ms(1, context))
    e, p, d = model.encode, model.prefill, model.decode
    work_ms = ((e.per_image_ms + e.per_mpixel_ms * mpixels) * IMAGES + p.per_token_ms * prompt
               + p.per_ktoken2_ms * (prompt / 1000) ** 2
               + out * (d.per_seq_ms + d.per_kctx_ms * context / 1000))
    scale = model.time_scale / 1000
    return REFERENCE_GPUS / (alone_ms * scale), REFERENCE_GPUS / (work_ms * scale)


def servability(model: CostModel) -> str | None:
    """Why the benchmark workload cannot be served on `model` (None: it can), by the cost
    model's own formulas: an aggregated candidate on at most REFERENCE_GPUS GPUs (TP 1, 2
    or 4, where the heads divide it), one request at a time, holds SLO_SHARE of the SLO
    (TTFT: its encode and prefill step; TPOT: a decode step of one) and fits its weights and
    one request's KV; and the knee bounds overlap KNEE_RANGE. A machine that needs TP to
    hold the TPOT (as decode-heavy does: 76 ms at TP1 against 60) is kept: tune must find
    that too."""
    why = ""
    for tp in (1, 2, 4):
        if tp <= REFERENCE_GPUS and model.model.heads % tp == 0:
            why = _alone(model, tp) or ""
            if not why:
                break
    if why:
        return why
    low, high = knee_bounds(model)
    if low > KNEE_RANGE[1] or high < KNEE_RANGE[0]:
        return f"knee between {low:.2f} and {high:.1f} req/s"
    return None


def _alone(model: CostModel, tp: int) -> str | None:
    """Why an aggregated instance at TP `tp` cannot serve one request at a time (None: it
    can)."""
    mpixels, prompt, context = _request(model)
    ttft = model.step_ms(mpixels=[mpixels] * IMAGES, tokens=[prompt], tp=tp) * model.time_scale
    tpot = model.step_ms(batch=1, context=context, tp=tp) * model.time_scale
    if ttft > SLO_SHARE * SLO_MS["ttft"]:
        return f"TTFT {ttft:.0f} ms alone at TP{tp}"
    if tpot > SLO_SHARE * SLO_MS["tpot"]:
        return f"TPOT {tpot:.1f} ms alone at TP{tp}"
    need = model.weights_bytes("prefill_decode") + context * model.model.kv_per_token
    if need > model.gpu.memory * model.utilization * tp:
        return f"{need / GIB:.1f} GiB on {tp} GPU(s)"
    return None


def write(model: CostModel, path: str | Path) -> Path:
    """`model` as a cost-model YAML (every field, sizes in bytes), for the fake engine."""
    import yaml

    path = Path(path)
    head = "# A random simulated machine (epdctl.sim.machines.draw); format in docs/tune.md.\n"
    path.write_text(head + yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False))
    return path


def ranges_table() -> str:
    """RANGES as the Markdown table of docs/tune.md "Random machines" (a test keeps the two
    the same)."""
    def shown(key: str, value: float) -> str:
        if key in ("model.weights", "model.encoder_weights"):
            return f"{value / GIB:g} GiB"
        return f"{value / KIB:g} KiB" if key == "model.kv_per_token" else f"{value:g}"

    rows = ["| field | low | high | drawn |", "|---|---|---|---|"]
    for key, r in RANGES.items():
        how = "log-uniform" if r.is_log else "uniform"
        how = "one of " + ", ".join(map(str, r.choices)) if r.choices else how
        how += ", integer" if r.is_int and not r.choices else ""
        how += f"; null (unchunked) on {r.none_share:.0%}" if r.none_share else ""
        how += f"; exactly {r.low:g} on {r.low_share:.0%}" if r.low_share else ""
        rows.append(f"| `{key}` | {shown(key, r.low)} | {shown(key, r.high)} | {how} |")
    return "\n".join(rows)
