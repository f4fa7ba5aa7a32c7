"""EpdctlShmECConnector: vLLM's ECConnectorBase on top of the shared-memory store."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
from vllm.logger import init_logger

from epdctl import cache
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Store, unpin
from epdctl.connector import _io
from epdctl.connector._scheduler import EpdctlECMetadata, SchedulerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under `vllm.`: vLLM configures only its own logger tree (handler, VLLM_LOGGING_LEVEL).
logger = init_logger(f"vllm.{__name__}")



class EpdctlShmECConnector(ECConnectorBase):
    """E saves each encoder output to tmpfs; P/PD pin, validate and load it."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        cfg = vllm_config.ec_transfer_config
        assert cfg is not None  # the base class raised otherwise
        extra = cfg.ec_connector_extra_config
        capacity = extra.get("capacity_bytes")
        self._store = Store(
            extra.get("store_dir", cache.default_store_root()), extra.get("namespace", "default"),
            # Within it E keeps spare pre-faulted files; none without a (sane) capacity.
            capacity if type(capacity) is int and capacity > 0 else None,
        ).open()
        if self._store.refused is not None:
            # Another user's (or a world-writable) directory: never read what may be planted
            # there, never write into it. The engine keeps serving, encoding locally.
            logger.error("EC store: %s; not using it: every item is encoded locally and "
                         "nothing is saved", self._store.refused)
        self._engine_id = str(cfg.engine_id)
        dtype = vllm_config.model_config.dtype
        # Resolved to a torch.dtype by vLLM's config; entries of another dtype are misses.
        self._dtype = _io.dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
        parallel = vllm_config.parallel_config
        # Every TP x PCP rank of the first PP stage loads, each through its own pin.
        ranks = parallel.tensor_parallel_size * parallel.prefill_context_parallel_size
        self._stats: StatsWriter | None = None
        self._sched = SchedulerSide(
            self._store,
            engine_id=self._engine_id,
            dtype=self._dtype,
            ranks=ranks,
            resolver=PlaceholderMetadataResolver(vllm_config.model_config),
            stat=self._stat,
        )
        # Worker side (lazy: the distributed groups exist only later).
        self._rank: int | None = None
        self._staging: _io.HostStaging | None = None
        self._is_watching = False

    def _stat(self, key: str | None = None, **counts: float) -> None:
        if self._store.refused is not None:
            return  # the stats files live in the refused directory too
        if self._stats is None:
            side = "scheduler" if self.role == ECConnectorRole.SCHEDULER else f"worker{self._rank}"
            self._stats = StatsWriter(self._store.root, f"{self._engine_id}-{side}")
        self._stats.add(key, **counts)

    @override
    def has_cache_item(self, identifier: str) -> bool:
        """Scheduler side: True only for an entry this connector pinned and validated."""
        # E always encodes (False): a fresh save also replaces a damaged entry.
        return self._sched.has(identifier)

    @override
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Scheduler side: pin every needed entry, or choose local encoding, or fail."""
        if self.is_consumer:
            return self._sched.ensure(request, num_computed_tokens)
        if self.is_producer:
            self._sched.produce(request)
        return True

    @override
    def take_unavailable_requests(self) -> set[str]:
        """Scheduler side: requests whose entries are gone and that have no media."""
        return self._sched.take_unavailable()

    @override
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Scheduler side: hand a pinned entry to the workers for this step."""
        self._sched.after_alloc(request, index)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """Scheduler side: this step's loads; a fresh object each step, never mutated later."""
        return self._sched.take_meta()

    @override
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side: drop unused pins; on E, report items whose entry is committed."""
        return False, self._sched.finished(request, is_producer=self.is_producer)

    @override
    def has_pending_push_work(self) -> bool:
        """Scheduler side: nothing is pushed; entries are complete when E answers."""
        return False

    @override
    def start_save_caches(self, **kwargs: Any) -> None:
        """Worker side: publish local-cache hits that are missing from the store."""
        encoder_cache = kwargs.get("encoder_cache")
        meta = self._connector_metadata
        if encoder_cache is None or not isinstance(meta, EpdctlECMetadata):
            return
        for key in meta.republish:
            if key in encoder_cache and not self._store.has_entry(key):
                self.save_caches(encoder_cache, key)

    @override
    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Worker side: write the entry (rank 0 of a producer only); never raises."""
        # V1 calls this in every role, also when a consumer encodes locally.
        if not self.is_producer or self._store.refused is not None:
            return
        if self._worker_rank() != 0 or mm_hash not in encoder_cache:
            return
        start = time.perf_counter()
        try:
            with _sync_allowed():
                nbytes = _io.save_tensor(self._store, mm_hash, encoder_cache[mm_hash], self._host())
        except Exception as exc:  # a full tmpfs must not kill the encoder
            logger.warning("EC store: could not save %s: %s", mm_hash, exc)
            self._stat(save_failures=1)
            return
        self._stat(saves=1, save_bytes=nbytes, save_s=time.perf_counter() - start)
        logger.debug("EC store: saved %s (%d bytes)", mm_hash, nbytes)

    @override
    def start_worker_services(self) -> None:
        """Worker side: a consumer maps the pool's files ahead, as E stocks them."""
        self._watch_pool()

    @override
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Worker side: read this step's entries through this rank's pins, then unpin."""
        meta = self._connector_metadata
        if not isinstance(meta, EpdctlECMetadata) or not meta.loads:
            return
        self._watch_pool()  # a vLLM that never calls start_worker_services
        rank = self._worker_rank()
        todo = [load for load in meta.loads if load.mm_hash not in encoder_cache]
        start = time.perf_counter()
        tensors = _io.load_tensors(
            [(load.paths[rank : rank + 1], load.header) for load in todo],
            self._device(),
            self._host(),
        )
        elapsed = time.perf_counter() - start
        for load, tensor in zip(todo, tensors, strict=True):
            if isinstance(tensor, torch.Tensor):
                encoder_cache[load.mm_hash] = tensor
                # No key: the scheduler counted this item's hit (one per request item, not
                # one more per loading rank).
                self._stat(loads=1, load_bytes=load.header.nbytes, load_s=elapsed)
                logger.debug("Success load encoder cache for hash %s", load.mm_hash)
            else:
                # Only a pin removed by hand gets here (never the entry's own name: its
                # file may be recycled); vLLM then reports the cache miss.
                logger.error("EC store: could not load %s: %s", load.mm_hash, tensor)
                self._stat(load_failures=1)
        unpin([load.paths[rank] for load in meta.loads if rank < len(load.paths)])

    def _watch_pool(self) -> None:
        if self._is_watching or not self.is_consumer or self._store.refused is not None:
            return
        self._is_watching = True
        try:
            self._store.watch_pool()
        except Exception as exc:  # reads still work, through mappings made on first use
            logger.warning("EC store: not mapping the pool ahead: %s", exc)

    def _worker_rank(self) -> int:
        if self._rank is None:
            from vllm.distributed.parallel_state import (
                get_pcp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp = get_tensor_model_parallel_world_size()
            self._rank = get_tensor_model_parallel_rank() + tp * get_pcp_group().rank_in_group
        return self._rank

    def _device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike():
            return torch.device(current_platform.device_type, torch.cuda.current_device())
        return torch.device(current_platform.device_type)

    def _host(self) -> _io.HostStaging:
        if self._staging is None:
            self._staging = _io.HostStaging(self._device())
        return self._staging

    @override
    def shutdown(self) -> None:
        """Both sides: release pins no worker will read, write the last stats."""
        self._sched.release_all()
        self._store.close()
        if self._stats is not None:
            self._stats.close()


def _sync_allowed() -> Any:
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    return gpu_sync_allowed()
