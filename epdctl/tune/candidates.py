"""Every topology of the base's model on some devices that can work: aggregated (DP x TP),
E|PD and E|P|D with any replica counts, TP sizes the heads divide, E on a GPU of its own or
sharing one with PD (or P), kept where weights and KV fit (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from epdctl.bench.arms import NAME_MAX, max_model_len
from epdctl.topology.model import Role, Topology, parse_topology
from epdctl.tune.facts import ModelFacts

Kind = Literal["aggregated", "e-pd", "epd"]
TP_SIZES = (1, 2, 4, 8)
UTILIZATION = 0.9
"""vLLM's default --gpu-memory-utilization: what a GPU of its own gives one instance."""
MIN_SEQS = 4
"""An instance must hold the KV of at least this many of the workload's requests."""
GIB = 1 << 30


@dataclass(frozen=True)
class Pool:
    replicas: int = 0
    tp: int = 1

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    def label(self, role: str) -> str:
        return f"{self.replicas}{role}" + (f"(TP{self.tp})" if self.tp > 1 else "")


@dataclass(frozen=True)
class Shape:
    """A candidate's roles, before it is placed on GPUs."""

    kind: Kind
    encoders: int = 0
    shared: bool = False
    """E sits on the first GPU of a PD (E|PD) or P (E|P|D) replica, one E per replica."""
    pd: Pool = Pool()
    prefill: Pool = Pool()
    decode: Pool = Pool()

    @property
    def gpus(self) -> int:
        own = 0 if self.shared else self.encoders
        return own + self.pd.gpus + self.prefill.gpus + self.decode.gpus

    @property
    def label(self) -> str:
        """`2PD(TP2)`, `1E+3PD`, `2E~2PD` (~: E shares PD's GPUs), `1E+1P+2D`."""
        join = "~" if self.shared else "+"
        if self.kind == "aggregated":
            return self.pd.label("PD")
        if self.kind == "e-pd":
            return f"{self.encoders}E{join}{self.pd.label('PD')}"
        return f"{self.encoders}E{join}{self.prefill.label('P')}+{self.decode.label('D')}"

    @property
    def family(self) -> str:
        """What the shape spends its language-model devices on: its kind, the ratio of its
        P and D (or PD) replicas reduced, and their TP sizes: `2P+1D(TP2)` holds
        1E~2P+1D(TP2) and 2E~2P+1D(TP2), `1P+1D` holds 1E+1P+1D and 2E~2P+2D. E's count is
        left out: the model meets E at the batches it profiled, where the language-model
        stages are extrapolated, and the two families it once inverted differed there
        (tune's family rule, decide.next_step)."""
        if self.kind == "epd":
            n = math.gcd(self.prefill.replicas, self.decode.replicas)
            split = (f"{Pool(self.prefill.replicas // n, self.prefill.tp).label('P')}"
                     f"+{Pool(self.decode.replicas // n, self.decode.tp).label('D')}")
        else:
            split = Pool(1, self.pd.tp).label("PD")
        return f"{self.kind}:{split}"

    @property
    def tag(self) -> str:
        """The label as a topology-name suffix."""
        return (self.label.lower().replace("(tp", "t").replace(")", "").replace("~", "s")
                .replace("+", "-"))


@dataclass(frozen=True)
class Limits:
    """What a candidate must fit in."""

    gpu_memory: int | None
    """Bytes per GPU (None: unknown, memory is not checked)."""
    kv_tokens: int
    """KV cache tokens each P, D or PD instance must hold."""
    encoder_fraction: float = 0.1
    """Share of a GPU a shared E gets (PD or P gets UTILIZATION minus it)."""


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    topology: Topology
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.topology.name


def tp_sizes(gpus: int, heads: int | None) -> list[int]:
    return [t for t in TP_SIZES if t <= gpus and (heads is None or heads % t == 0)]


def shapes(gpus: int, tps: Sequence[int], *, is_cpu: bool = False) -> list[Shape]:
    """Every shape that uses exactly `gpus` devices (CPU: instances; TP 1, no sharing)."""
    tps = [1] if is_cpu else list(tps)
    out = [Shape("aggregated", pd=Pool(gpus // t, t)) for t in tps if gpus % t == 0]
    for e in range(1, gpus):
        out += [Shape("e-pd", e, pd=Pool((gpus - e) // t, t)) for t in tps
                if (gpus - e) % t == 0]
    if not is_cpu:
        for t in tps:
            if gpus % t == 0:
                out += [Shape("e-pd", e, True, pd=Pool(gpus // t, t))
                        for e in range(1, gpus // t + 1)]
    for own in ([False] if is_cpu else [False, True]):
        for e in range(1, gpus - 1 if not own else gpus + 1):
            rest = gpus if own else gpus - e
            for tp_p in tps:
                for tp_d in tps:
                    for p in range(1, rest // tp_p + 1):
                        left = rest - p * tp_p
                        if left <= 0 or left % tp_d or (own and e > p):
                            continue
                        out.append(Shape("epd", e, own, prefill=Pool(p, tp_p),
                                         decode=Pool(left // tp_d, tp_d)))
    return out


def request_tokens(facts: ModelFacts, images: int, image_size: tuple[int, int],
                   input_len: int, output_len: int) -> int:
    """KV tokens one request of the workload takes at its end."""
    mpixels = image_size[0] * image_size[1] / 1e6
    return input_len + output_len + math.ceil(images * mpixels * facts.image_tokens_per_mpixel)


def limits_for(base: Topology, facts: ModelFacts, gpu_memory: int | None,
               tokens_per_request: int) -> Limits:
    need = max(max_model_len(base) or 0, tokens_per_request * MIN_SEQS)
    fraction = 0.1
    if gpu_memory:
        fraction = max(0.05, math.ceil((facts.encoder_weights * 1.5 + GIB) / gpu_memory * 100)
                       / 100)
    return Limits(gpu_memory, need, fraction)


def _weights(facts: ModelFacts, role: str) -> int:
    if role == "encode":
        return facts.encoder_weights
    return facts.weights + (facts.encoder_weights if role in ("prefill_decode", "prefill")
                            else 0)


def misfit(shape: Shape, facts: ModelFacts, limits: Limits) -> str | None:
    """Why the shape does not fit in memory (None: it fits, or memory is unknown)."""
    if limits.gpu_memory is None:
        return None
    mem = limits.gpu_memory
    host = "prefill_decode" if shape.kind != "epd" else "prefill"
    pools = [("prefill_decode", shape.pd), ("prefill", shape.prefill), ("decode", shape.decode)]
    for role, pool in pools:
        if not pool.replicas:
            continue
        share = UTILIZATION - (limits.encoder_fraction if shape.shared and role == host else 0)
        budget = share * mem * pool.tp
        weights = _weights(facts, role)
        if weights > budget:
            return (f"{role} TP{pool.tp}: weights {weights / GIB:.1f} GiB do not fit in "
                    f"{budget / GIB:.1f} GiB")
        if facts.kv_per_token and (budget - weights) / facts.kv_per_token < limits.kv_tokens:
            return (f"{role} TP{pool.tp}: KV for {limits.kv_tokens} tokens does not fit in "
                    f"{(budget - weights) / GIB:.1f} GiB")
    if shape.encoders:
        e_budget = (limits.encoder_fraction if shape.shared else UTILIZATION) * mem
        if facts.encoder_weights > e_budget:
            return f"encode: weights do not fit in {e_budget / GIB:.1f} GiB"
    return None


def _role(base: Topology, name: str) -> dict[str, Any]:
    """args and env for a role of the candidate: the base's same role, else its nearest."""
    order = {"encode": ["encode"], "prefill_decode": ["prefill_decode", "prefill", "decode"],
             "prefill": ["prefill", "prefill_decode"], "decode": ["decode", "prefill_decode"]}
    source: Role | None = next((base.roles[r] for r in order[name] if r in base.roles), None)
    return {"args": list(source.args), "env": dict(source.env)} if source else {}


def _name(base: str, tag: str) -> str:
    return f"{base[: NAME_MAX - len(tag) - 1].rstrip('-')}-{tag}"


def place(base: Topology, shape: Shape, gpus: Sequence[int], limits: Limits) -> Topology:
    """The shape as a topology for `up`, on these GPU indices (in order), validated."""
    is_cpu = base.device == "cpu"
    free = list(gpus)
    roles: dict[str, dict[str, Any]] = {}

    def take(pool: Pool) -> list[int]:
        nonlocal free
        got, free = free[: pool.gpus], free[pool.gpus:]
        return got

    if shape.encoders and not shape.shared:
        roles["encode"] = {**_role(base, "encode"), "replicas": shape.encoders,
                           **({} if is_cpu else {"gpus": take(Pool(shape.encoders))})}
    for role, pool in (("prefill_decode", shape.pd), ("prefill", shape.prefill),
                       ("decode", shape.decode)):
        if pool.replicas:
            roles[role] = {**_role(base, role), "replicas": pool.replicas}
            if not is_cpu:
                roles[role].update(tensor_parallel=pool.tp, gpus=take(pool))
    if shape.shared:
        host = roles["prefill_decode" if shape.kind == "e-pd" else "prefill"]
        tp = host["tensor_parallel"]
        e_gpus = [host["gpus"][r * tp] for r in range(shape.encoders)]
        roles = {"encode": {**_role(base, "encode"), "replicas": shape.encoders,
                            "gpus": e_gpus,
                            "gpu_memory_utilization": limits.encoder_fraction}, **roles}
        host["gpu_memory_utilization"] = round(UTILIZATION - limits.encoder_fraction, 4)
    data = base.model_dump(mode="json", exclude_unset=True)
    data.update(name=_name(base.name, shape.tag), roles=roles)
    data.pop("rebalance", None)  # a candidate is measured as it is: nothing moves its GPUs
    return parse_topology(data, f"candidate {shape.label}")


def candidates(base: Topology, gpus: Sequence[int], facts: ModelFacts, limits: Limits
               ) -> tuple[list[Candidate], list[tuple[Shape, str]]]:
    """The candidates that fit, and the shapes left out with the reason why."""
    is_cpu = base.device == "cpu"
    kept: list[Candidate] = []
    left_out: list[tuple[Shape, str]] = []
    for shape in shapes(len(gpus), tp_sizes(len(gpus), facts.heads), is_cpu=is_cpu):
        reason = None if is_cpu else misfit(shape, facts, limits)
        if reason is not None:
            left_out.append((shape, reason))
            continue
        kept.append(Candidate(shape, place(base, shape, gpus, limits)))
    return kept, left_out
