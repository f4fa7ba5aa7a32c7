"""The arms of a bench: the topology as written, a baseline derived from it, more files (pure).

The aggregated baseline is the same model on the same devices without disaggregation: no
`encode`, and every device the topology uses given to prefill+decode replicas that keep the
PD (or prefill/decode) role's tensor parallel size. On `device: cpu` it has as many
instances as the topology, all of them prefill+decode. `--baseline tp` is one instance over
all the devices instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from epdctl.errors import BenchError
from epdctl.topology.model import Role, Topology, flag_value

Baseline = Literal["aggregated", "tp", "none"]
Kind = Literal["epd", "baseline", "extra"]
NAME_MAX = 42


@dataclass(frozen=True)
class Arm:
    """One topology the workload runs against."""

    name: str
    """`epd`, `aggregated`, `tp`, or an `--arm` file's topology name."""
    kind: Kind
    topology: Topology
    path: Path
    """The file it is, or (derived arms) the file it was derived from."""
    notes: tuple[str, ...] = ()
    """How it was derived, and what it leaves out."""


def derive_arms(topology: Topology, path: Path, baseline: Baseline = "aggregated",
                extra: Sequence[tuple[Path, Topology]] = ()) -> list[Arm]:
    """The arms in the order they run: the topology, the baseline, then the `--arm` files."""
    arms = [Arm("epd", "epd", topology, path)]
    if baseline == "aggregated":
        derived, notes = aggregated(topology)
        arms.append(Arm("aggregated", "baseline", derived, path, notes))
    elif baseline == "tp":
        derived, notes = one_instance(topology)
        arms.append(Arm("tp", "baseline", derived, path, notes))
    for extra_path, other in extra:
        _check_same(topology, other, extra_path)
        arms.append(Arm(other.name, "extra", other, extra_path))
    names = [a.name for a in arms]
    states = [a.topology.name for a in arms]
    for i, arm in enumerate(arms):
        if names.index(arm.name) != i or states.index(arm.topology.name) != i:
            raise BenchError(f"--arm {arm.path}: the name `{arm.topology.name}` is taken by "
                             "another arm; give the topology another `name:`")
    return arms


def _check_same(topology: Topology, other: Topology, path: Path) -> None:
    if other.model != topology.model:
        raise BenchError(f"--arm {path}: model `{other.model}` is not the topology's "
                         f"`{topology.model}`; every arm must serve the same model")
    if other.device != topology.device:
        raise BenchError(f"--arm {path}: `device: {other.device}` is not the topology's "
                         f"`device: {topology.device}`")


def devices(topology: Topology) -> tuple[list[int], int]:
    """The GPU indices the roles list (in order, each once) and how many more they pick."""
    listed: list[int] = []
    counted = 0
    for role in topology.roles.values():
        if isinstance(role.gpus, list):
            listed += [g for g in role.gpus if g not in listed]
        else:
            counted += role.replicas * role.tensor_parallel
    return listed, counted


def serving_role(topology: Topology) -> tuple[Role, int]:
    """The role a baseline's replicas copy args and env from, and the TP they keep."""
    if "prefill_decode" in topology.roles:
        role = topology.roles["prefill_decode"]
        return role, role.tensor_parallel
    prefill, decode = topology.roles["prefill"], topology.roles["decode"]
    # The larger size: a model that needs TP2 to fit on one side needs it on one replica.
    return prefill, max(prefill.tensor_parallel, decode.tensor_parallel)


def _renamed(name: str, suffix: str) -> str:
    return f"{name[: NAME_MAX - len(suffix) - 1].rstrip('-')}-{suffix}"


def _with_roles(topology: Topology, name: str, roles: dict[str, Any]) -> Topology:
    data = topology.model_dump()
    data.update(name=name, roles=roles)
    return Topology.model_validate(data)


def _fraction(topology: Topology, source: Role) -> float | None:
    """The GPU memory share a baseline replica gets: what the roles sharing a GPU had
    together (the least over shared GPUs), else what the serving role had."""
    users: dict[int, list[float | None]] = {}
    for role in topology.roles.values():
        if isinstance(role.gpus, list):
            for gpu in role.gpus:
                users.setdefault(gpu, []).append(role.gpu_memory_utilization)
    shared = [sum(f for f in fs if f is not None) for fs in users.values()
              if len(fs) > 1 and None not in fs]
    if shared:
        return round(min(1.0, min(shared)), 4)
    return source.gpu_memory_utilization


def _gpus(topology: Topology, need: int) -> tuple[list[int] | int, list[str]]:
    listed, counted = devices(topology)
    if not counted:
        left = listed[need:]
        notes = [f"GPU {', '.join(map(str, left))} left unused (not a multiple of the "
                 "tensor parallel size)"] if left else []
        return listed[:need], notes
    if not listed:
        return need, []
    return need, ["some roles pick GPUs by count: the baseline picks its own, which may "
                  "not be the topology's"]


def aggregated(topology: Topology) -> tuple[Topology, tuple[str, ...]]:
    """No encoder; the topology's devices (CPU: its instance count) as PD replicas."""
    source, tp = serving_role(topology)
    base = {"args": list(source.args), "env": dict(source.env)}
    if topology.device == "cpu":
        count = sum(r.replicas for r in topology.roles.values())
        roles = {"prefill_decode": {**base, "replicas": count}}
        note = f"{count} prefill+decode instance(s), as many as the topology has"
        return _with_roles(topology, _renamed(topology.name, "agg"), roles), (note,)
    listed, counted = devices(topology)
    total = len(listed) + counted
    replicas = total // tp
    if replicas == 0:
        raise BenchError(f"the aggregated baseline needs {tp} GPUs for one replica "
                         f"(tensor_parallel {tp}); the topology uses {total}")
    gpus, notes = _gpus(topology, replicas * tp)
    roles = {"prefill_decode": {**base, "replicas": replicas, "tensor_parallel": tp,
                                "gpus": gpus,
                                "gpu_memory_utilization": _fraction(topology, source)}}
    notes.insert(0, f"{replicas} prefill+decode replica(s) x tensor_parallel {tp} on "
                    f"{total} GPU(s)")
    return _with_roles(topology, _renamed(topology.name, "agg"), roles), tuple(notes)


def one_instance(topology: Topology) -> tuple[Topology, tuple[str, ...]]:
    """`--baseline tp`: one prefill+decode instance, tensor parallel over every device."""
    if topology.device == "cpu":
        raise BenchError("--baseline tp needs `device: cuda` (a CPU instance has no tensor "
                         "parallelism); use the default aggregated baseline")
    source, _ = serving_role(topology)
    listed, counted = devices(topology)
    total = len(listed) + counted
    heads = attention_heads(topology.model)
    if heads is not None and heads % total:
        raise BenchError(f"--baseline tp: {topology.model} has {heads} attention heads, "
                         f"which tensor_parallel {total} does not divide")
    gpus, notes = _gpus(topology, total)
    roles = {"prefill_decode": {"args": list(source.args), "env": dict(source.env),
                                "tensor_parallel": total, "gpus": gpus,
                                "gpu_memory_utilization": _fraction(topology, source)}}
    notes.insert(0, f"1 prefill+decode instance, tensor_parallel {total}")
    return _with_roles(topology, _renamed(topology.name, "tp"), roles), tuple(notes)


def attention_heads(model: str) -> int | None:
    """num_attention_heads of a local model's config (its text model's), else None."""
    config = Path(model) / "config.json"
    if not Path(model).is_absolute() or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config") or data
    heads = text.get("num_attention_heads") if isinstance(text, dict) else None
    return heads if isinstance(heads, int) and heads > 0 else None


def _role_args(topology: Topology, roles: Sequence[str]) -> list[list[str]]:
    return [[*topology.engine.args, *topology.roles[r].args] for r in roles
            if r in topology.roles]


def image_limit(topology: Topology, modality: str = "image") -> int | None:
    """The fewest images (or items of `modality`) per prompt any instance accepts
    (`--limit-mm-per-prompt`); None: not set (vLLM's default), or not in a form read here."""
    limits = []
    for args in _role_args(topology, list(topology.roles)):
        value = flag_value(args, "--limit-mm-per-prompt")
        try:
            limit = json.loads(value)[modality] if value else None
        except (ValueError, KeyError, TypeError):
            limit = None
        if isinstance(limit, int):
            limits.append(limit)
    return min(limits) if limits else None


def max_model_len(topology: Topology) -> int | None:
    """The smallest `--max-model-len` of the serving instances; None: the model's own."""
    lengths = []
    for args in _role_args(topology, ["prefill_decode", "prefill", "decode"]):
        value = flag_value(args, "--max-model-len")
        if value and value.isdigit():
            lengths.append(int(value))
    return min(lengths) if lengths else None
