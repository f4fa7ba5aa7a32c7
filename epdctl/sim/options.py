"""The fake engine's command line: what epdctl's plan gives `vllm serve`, read by hand.

argparse would choke on vLLM's JSON values and on flags the fake engine does not know;
those are accepted and ignored. The role comes from the transfer configs, as in vLLM: an EC
producer is E, a KV producer P, a KV consumer D, anything else PD.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COST_MODEL_ENV = "EPDCTL_SIM_COST_MODEL"
DEFAULT_MAX_MODEL_LEN = 4096
_VALUED = {"--port", "--host", "--served-model-name", "--tensor-parallel-size",
           "--gpu-memory-utilization", "--ec-transfer-config", "--kv-transfer-config",
           "--max-num-seqs", "--max-model-len", "--cost-model", "--model", "-tp"}


@dataclass(frozen=True)
class Options:
    model: str = "fake-model"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    tensor_parallel: int = 1
    gpu_memory_utilization: float | None = None
    ec_config: dict[str, Any] = field(default_factory=dict)
    kv_config: dict[str, Any] = field(default_factory=dict)
    max_num_seqs: int | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    cost_model: str | None = None
    gpus: tuple[str, ...] = ()
    """CUDA_VISIBLE_DEVICES: the fake GPUs this instance runs on."""

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def role(self) -> str:
        if self.ec_config.get("ec_role") == "ec_producer":
            return "encode"
        kv_role = self.kv_config.get("kv_role")
        if kv_role == "kv_producer":
            return "prefill"
        if kv_role == "kv_consumer":
            return "decode"
        return "prefill_decode"

    @property
    def is_ec_consumer(self) -> bool:
        """E encodes this instance's images (it loads them from the EC store)."""
        return self.ec_config.get("ec_role") == "ec_consumer"


def _json(flag: str, value: str) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError:
        raise SystemExit(f"epdctl.sim.engine: {flag}: not JSON: {value!r}") from None
    return data if isinstance(data, dict) else {}


def parse_options(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
    """Options from argv (as `vllm serve MODEL --flag value ...`) and the environment."""
    environ = os.environ if environ is None else environ
    values: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        key, eq, inline = argv[i].partition("=")
        if key in _VALUED:
            if eq:
                values[key] = inline
                i += 1
            elif i + 1 < len(argv):
                values[key] = argv[i + 1]
                i += 2
            else:
                raise SystemExit(f"epdctl.sim.engine: {key} needs a value")
            continue
        if not argv[i].startswith("-"):
            positional.append(argv[i])
        i += 1
    gpus = tuple(g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                 if g.strip())
    try:
        return Options(
            model=values.get("--model") or (positional[0] if positional else "fake-model"),
            host=values.get("--host", "127.0.0.1"), port=int(values.get("--port", "8000")),
            served_model_name=values.get("--served-model-name"),
            tensor_parallel=int(values.get("--tensor-parallel-size")
                                or values.get("-tp") or "1"),
            gpu_memory_utilization=(float(values["--gpu-memory-utilization"])
                                    if "--gpu-memory-utilization" in values else None),
            ec_config=_json("--ec-transfer-config", values["--ec-transfer-config"])
            if "--ec-transfer-config" in values else {},
            kv_config=_json("--kv-transfer-config", values["--kv-transfer-config"])
            if "--kv-transfer-config" in values else {},
            max_num_seqs=int(values["--max-num-seqs"]) if "--max-num-seqs" in values else None,
            max_model_len=int(values.get("--max-model-len", DEFAULT_MAX_MODEL_LEN)),
            cost_model=values.get("--cost-model") or environ.get(COST_MODEL_ENV),
            gpus=gpus)
    except ValueError as exc:
        raise SystemExit(f"epdctl.sim.engine: bad option value: {exc}") from None
