"""Fakes for the doctor's probes: a scripted subprocess runner, GPUs, disk usage."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdctl.doctor import Completed
from epdctl.host.gpus import GpuInfo
from epdctl.topology.model import Topology, parse_topology

GIB = 1 << 30
Usage = namedtuple("Usage", "total used free")  # as shutil.disk_usage answers


def topology(**fields: Any) -> Topology:
    """A valid topology: E|PD on CUDA GPUs 0 and 1 unless fields say otherwise."""
    data: dict[str, Any] = {"name": "t", "model": "org/model", "roles": {
        "encode": {"gpus": [0]}, "prefill_decode": {"gpus": [1]}}}
    data.update(fields)
    return parse_topology(data)


def gpu(device_id: str, free_gib: float = 78, total_gib: float = 80) -> GpuInfo:
    return GpuInfo(device_id, "NVIDIA H100", int(total_gib * GIB), int(free_gib * GIB))


@dataclass
class FakeRunner:
    """Answers each command by the first of its argv words found in `answers`."""

    answers: dict[str, Completed] = field(default_factory=dict)
    calls: list[tuple[list[str], dict[str, str], float]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], env: Mapping[str, str],
                 timeout_s: float) -> Completed:
        self.calls.append((list(argv), dict(env), timeout_s))
        for word in argv:
            if word in self.answers:
                return self.answers[word]
        raise AssertionError(f"unexpected command {list(argv)}")


def disk(free_gib: float, total_gib: float = 64) -> Any:
    """A disk_usage fake reporting these sizes for any path."""
    usage = Usage(int(total_gib * GIB), 0, int(free_gib * GIB))
    seen: list[Path] = []

    def disk_usage(path: Path) -> Any:
        seen.append(Path(path))
        return usage

    disk_usage.seen = seen  # type: ignore[attr-defined]
    return disk_usage
