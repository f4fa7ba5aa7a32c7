"""What an EC consumer's connector costs each engine step of a text-only decode, in-process.

    .venv/bin/python benchmarks/connector_step.py [--batch 4] [--steps 20000] [--repeats 7]
        [--tpot-ms 1.75]

Every engine step vLLM calls a consumer's connector on both sides, whether or not anything
is loaded: the scheduler builds the step's metadata (`build_connector_meta`), takes the
requests whose items are gone (`take_unavailable_requests`) and folds in the workers' output
(`update_connector_output`, `get_ec_connector_stats`); the metadata is pickled into the
SchedulerOutput for the worker, which binds it, calls `start_load_caches`, `get_finished`,
`build_connector_worker_meta` and clears it (vLLM's ECConnectorModelRunnerMixin). This
makes those calls, in that order, for a decode step of `--batch` running text requests,
on epdctl's connector and on vLLM's ECExampleConnector (the same role, real classes,
stand-in configs), arms alternating, and prints the median time per step of each: the
part of a step that is the connector's own code, which a TPOT benchmark on two shared
cores (benchmarks/decode_speed.py) cannot resolve. The speed it leaves is
tpot / (tpot + step cost), at `--tpot-ms` (none's TPOT there: 1.75 ms at concurrency 1).

Needs the CPU build of vLLM (imports only; no engine is started). Ends with one key=value
line. Run 2026-12-02 (2-core AMD EPYC VM, batch 4, 7 x 20000 steps): ours 3.37 us a step
(timings 3.36-3.38), ECExampleConnector 4.61 us: at TPOT 1.75 ms, 0.998x and 0.997x.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.v1.outputs import ECConnectorOutput

from epdctl import cache
from epdctl.connector import EpdctlShmECConnector


def config(arm: str, root: Path) -> SimpleNamespace:
    if arm == "ours":
        ec = ECTransferConfig(ec_connector=cache.CONNECTOR_NAME, ec_role="ec_consumer",
                              engine_id="bench-pd",
                              ec_connector_extra_config={"store_dir": str(root),
                                                         "namespace": "bench"})
    else:
        ec = ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_consumer",
                              engine_id="bench-pd",
                              ec_connector_extra_config={"shared_storage_path":
                                                         str(root / "example")})
    return SimpleNamespace(
        ec_transfer_config=ec,
        model_config=SimpleNamespace(dtype=torch.float32, hf_config=SimpleNamespace()),
        parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                        prefill_context_parallel_size=1))


def make(arm: str, root: Path, role: ECConnectorRole) -> ECConnectorBase:
    cls = EpdctlShmECConnector if arm == "ours" else ECExampleConnector
    conn = cls(config(arm, root), role)  # type: ignore[arg-type]
    if isinstance(conn, EpdctlShmECConnector):
        conn._rank = 0  # no torch.distributed here
    return conn


def stepper(arm: str, root: Path, batch: int) -> Callable[[], None]:
    """One engine step's connector calls (scheduler, then worker), as vLLM makes them."""
    sched = make(arm, root, ECConnectorRole.SCHEDULER)
    worker = make(arm, root, ECConnectorRole.WORKER)
    scheduler_output = SimpleNamespace(finished_req_ids=set(),
                                       num_scheduled_tokens={f"r{i}": 1 for i in range(batch)})
    encoder_cache: dict[str, torch.Tensor] = {}
    last = ECConnectorOutput()

    def step() -> None:
        sched.take_unavailable_requests()
        sched.update_connector_output(last)
        sched.get_ec_connector_stats()
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output)))
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(encoder_cache)
        out = ECConnectorOutput()
        out.finished_sending, out.finished_recving = worker.get_finished(set())
        out.ec_connector_worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()

    return step


def per_step_us(step: Callable[[], None], steps: int) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4, help="running text requests a step")
    p.add_argument("--steps", type=int, default=20000, help="steps a timing")
    p.add_argument("--repeats", type=int, default=7, help="timings an arm (alternating)")
    p.add_argument("--tpot-ms", type=float, default=1.75,
                   help="the TPOT without a connector, for the speed left")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="epdctl-bench-step-", dir="/dev/shm"))
    try:
        arms = {arm: stepper(arm, root, a.batch) for arm in ("ours", "example")}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for step in arms.values():  # warm-up
            per_step_us(step, a.steps // 10)
        for _ in range(a.repeats):
            for arm, step in arms.items():
                times[arm].append(per_step_us(step, a.steps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures: dict[str, Any] = {}
    for arm, values in times.items():
        us = statistics.median(values)
        left = a.tpot_ms / (a.tpot_ms + us / 1000)
        print(f"{arm:<8} {us:6.2f} us a step (timings {min(values):.2f}-{max(values):.2f}); "
              f"at TPOT {a.tpot_ms} ms: decode speed {left:.4f}x of no connector")
        figures[f"{arm}_step_us"] = f"{us:.2f}"
        figures[f"{arm}_speed_left"] = f"{left:.4f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
