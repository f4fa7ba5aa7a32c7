"""A running topology's split as tune's Shape, the splits `epdctl switch` can reach from it
(the same devices, roles and instance sizes, instances moved between roles), and the moves
that get there (pure)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from epdctl.errors import PlanError
from epdctl.launch.state import SpecModel
from epdctl.tune.candidates import Pool, Shape


def running_shape(engines: list[SpecModel]) -> Shape:
    """The split the engines make; PlanError where a switch cannot move whole devices (an
    encoder shares a GPU with a PD or P, or a role's instances differ in size)."""
    roles = Counter(s.role for s in engines)
    sizes = {role: {s.tensor_parallel for s in engines if s.role == role} for role in roles}
    uneven = [role for role, tps in sizes.items() if len(tps) > 1]
    if uneven:
        raise PlanError(f"the {uneven[0]} instances differ in tensor_parallel: a split of "
                        "whole instances cannot be read off them")
    held = [set(s.gpus) for s in engines if s.role == "encode"]
    others = {g for s in engines if s.role != "encode" for g in s.gpus}
    if any(gpus & others for gpus in held):
        raise PlanError("an encoder shares a GPU with another role: rebalancing moves whole "
                        "GPUs between roles (give each instance GPUs of its own)")

    def pool(role: str) -> Pool:
        return Pool(roles[role], next(iter(sizes[role]))) if roles[role] else Pool()

    kind = "aggregated" if not roles["encode"] else "epd" if roles["prefill"] else "e-pd"
    return Shape(kind, roles["encode"], pd=pool("prefill_decode"),  # type: ignore[arg-type]
                 prefill=pool("prefill"), decode=pool("decode"))


def counts(shape: Shape) -> dict[str, int]:
    """Instances per role (its roles only)."""
    found = {"encode": shape.encoders, "prefill_decode": shape.pd.replicas,
             "prefill": shape.prefill.replicas, "decode": shape.decode.replicas}
    return {role: n for role, n in found.items() if n}


def sizes(shape: Shape) -> dict[str, int]:
    """Devices per instance, per role."""
    found = {"encode": 1, "prefill_decode": shape.pd.tp, "prefill": shape.prefill.tp,
             "decode": shape.decode.tp}
    return {role: found[role] for role in counts(shape)}


def with_counts(shape: Shape, new: dict[str, int]) -> Shape:
    return replace(shape, encoders=new.get("encode", 0),
                   pd=replace(shape.pd, replicas=new.get("prefill_decode", 0)),
                   prefill=replace(shape.prefill, replicas=new.get("prefill", 0)),
                   decode=replace(shape.decode, replicas=new.get("decode", 0)))


def reachable(shape: Shape) -> list[Shape]:
    """Every split with the same roles (each keeps one instance or more), the same devices
    and the same instance sizes, the running one first: one instance moved between two
    roles of one size at a time, as often as it takes."""
    seen = {tuple(sorted(counts(shape).items()))}
    found, frontier = [shape], [shape]
    while frontier:
        nxt = []
        for s in frontier:
            for a, b in _pairs(s):
                new = counts(s)
                new[a], new[b] = new[a] - 1, new[b] + 1
                key = tuple(sorted(new.items()))
                if new[a] >= 1 and key not in seen:
                    seen.add(key)
                    moved = with_counts(shape, new)
                    found.append(moved)
                    nxt.append(moved)
        frontier = nxt
    return found


def _pairs(shape: Shape) -> list[tuple[str, str]]:
    size = sizes(shape)
    return [(a, b) for a in size for b in size if a != b and size[a] == size[b]]


def moves(current: Shape, target: Shape) -> list[tuple[str, str]]:
    """The switches (from role, to role) that take `current` to `target`, one instance
    each: the roles that lose instances paired with those that gain, size for size."""
    have, want = counts(current), counts(target)
    losing = [r for r in have for _ in range(max(have[r] - want.get(r, 0), 0))]
    gaining = [r for r in want for _ in range(max(want[r] - have.get(r, 0), 0))]
    size = sizes(current)
    out = []
    for a in losing:
        b = next(g for g in gaining if size[g] == size[a])
        gaining.remove(b)
        out.append((a, b))
    return out


def without(shape: Shape, roles: list[str]) -> Shape:
    """The split while the instances leaving `roles` are away (one each: a switch's
    drain and start)."""
    new = counts(shape)
    for role in roles:
        new[role] -= 1
    return with_counts(shape, new)
