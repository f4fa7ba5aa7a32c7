"""Drive EpdctlShmECConnector the way vLLM's scheduler and workers do (stand-in configs)."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)

from epdctl.cache import CONNECTOR_NAME
from epdctl.connector import EpdctlShmECConnector

NS = "ns-unit"
SCHED, WORKER = ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER


class Resolver:
    """Stands in for vLLM's PlaceholderMetadataResolver of a Qwen2-VL-like model."""

    def fields_for(self, modality: str) -> set[str]:
        return {"image_grid_thw"}


def make(
    root: Path, role: ECConnectorRole, ec_role: str, *, dtype=None, tp: int = 1, rank: int = 0,
    capacity_bytes: int | None = None,
) -> EpdctlShmECConnector:
    extra: dict = {"store_dir": str(root), "namespace": NS}
    if capacity_bytes is not None:
        extra["capacity_bytes"] = capacity_bytes
    cfg = SimpleNamespace(
        ec_transfer_config=ECTransferConfig(
            ec_connector=CONNECTOR_NAME,
            ec_role=ec_role,
            engine_id=f"t-{ec_role}",
            ec_connector_extra_config=extra,
        ),
        model_config=SimpleNamespace(dtype=dtype or torch.float32),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1),
    )
    conn = EpdctlShmECConnector(cfg, role)  # type: ignore[arg-type]
    _made.append(conn)
    conn._sched._resolver = Resolver()  # type: ignore[assignment]
    conn._rank = rank  # no torch.distributed here
    return conn


_made: list[EpdctlShmECConnector] = []


def shutdown_all() -> None:
    while _made:
        _made.pop().shutdown()


def elem(t: torch.Tensor) -> MultiModalFieldElem:
    return MultiModalFieldElem(data=t, field=MultiModalSharedField(batch_size=1))


def feature(key: str, rows: int, *, media: bool = True) -> MultiModalFeatureSpec:
    data = {"image_grid_thw": elem(torch.tensor([1, 2, rows // 2]))}
    if media:
        data["pixel_values"] = elem(torch.zeros(4, 3))
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(data),
        modality="image",
        identifier=key,
        mm_position=PlaceholderRange(offset=3, length=rows),
    )


def request(rid: str, *features: MultiModalFeatureSpec) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, mm_features=list(features))


def step(sched: EpdctlShmECConnector, worker: EpdctlShmECConnector, cache: dict) -> None:
    """One engine step's hand-off: metadata pickled as the mp executor does."""
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))  # type: ignore[arg-type]
    worker.bind_connector_metadata(meta)
    if worker.is_producer:
        worker.start_save_caches(encoder_cache=cache)
    if worker.is_consumer:
        worker.start_load_caches(cache)
    worker.clear_connector_metadata()


def produce(root: Path, key: str, t: torch.Tensor) -> None:
    make(root, WORKER, "ec_producer").save_caches({key: t}, key)


def pins(root: Path) -> list[str]:
    return os.listdir(root / NS / "pins")


class ManualClock:
    """The scheduler side's clock (its `clock` seam), moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.epoch = time.time()  # a mark's deadline is an mtime: keep it near real time

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def manual_clock(sched: EpdctlShmECConnector) -> ManualClock:
    clock = ManualClock()
    sched._sched.clock = clock
    return clock
