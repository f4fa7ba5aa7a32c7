"""Bring each arm up through the run API, run the workload against it, take it down."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from epdctl.bench.arms import Arm
from epdctl.bench.workload import Workload, argv, bench_command, parse_result, write_dataset
from epdctl.errors import BenchError, EpdctlError, StartupError
from epdctl.state import RunState
from epdctl.verify import PROMPTS, ChatAnswer, Prompt, chat_body, send_chat

POLL_S = 1.0
# The store's counters are flushed at most once a second by each engine.
STATS_SETTLE_S = 1.2
STATS_WAIT_S = 6.0
LOG_TAIL_LINES = 15


class Progress(Protocol):
    """Where the runner reports what it is doing (the CLI prints it on stderr)."""

    def line(self, text: str) -> None: ...
    def tick(self, text: str) -> None: ...
    def on_change(self, state: RunState) -> None: ...
    def done_starting(self) -> None: ...


@dataclass
class PointRun:
    """One load point against one arm."""

    index: int
    argv: list[str]
    figures: dict[str, float | int | None]
    proxy: dict[str, float | None]
    store: dict[str, int] | None
    elapsed_s: float


@dataclass
class ArmRun:
    arm: Arm
    instances: list[dict[str, Any]] = field(default_factory=list)
    greedy: list[ChatAnswer] = field(default_factory=list)
    points: list[PointRun] = field(default_factory=list)


def greedy_prompts(limit: int | None) -> list[Prompt]:
    """verify's fixed prompts that fit the arms' image limit."""
    return [p for p in PROMPTS if p.modalities <= {"image"}
            and (limit is None or len(p.images) <= limit)]


def run_arms(arms: Sequence[Arm], workload: Workload, state_root: Path, work_dir: Path, *,
             timeout_s: float, progress: Progress, prompts: Sequence[Prompt]) -> list[ArmRun]:
    """Every arm in turn; each is down again before the next starts (and on any error)."""
    datasets = _datasets(workload, work_dir, progress)
    runs: list[ArmRun] = []
    for number, arm in enumerate(arms, 1):
        progress.line(f"[{number}/{len(arms)}] {arm.name}: starting {arm.topology.name} "
                      f"({arm.topology.mode})")
        runs.append(run_arm(arm, workload, state_root, work_dir, datasets, timeout_s=timeout_s,
                            progress=progress, prompts=prompts, earlier=runs))
    return runs


def _datasets(workload: Workload, work_dir: Path, progress: Progress) -> dict[int, Path]:
    if workload.kind != "generated":
        return {}
    paths = {}
    for index in range(len(workload.points)):
        path = work_dir / "datasets" / f"point-{index}.jsonl"
        counts = write_dataset(workload, index, path)
        progress.line(f"dataset {path}: {counts['images']} images, "
                      f"{counts['repeated_images']} of them repeats")
        paths[index] = path
    return paths


def run_arm(arm: Arm, workload: Workload, state_root: Path, work_dir: Path,
            datasets: Mapping[int, Path], *, timeout_s: float, progress: Progress,
            prompts: Sequence[Prompt], earlier: Sequence[ArmRun] = ()) -> ArmRun:
    from epdctl.run import prepare, start_detached, stop

    run = prepare(arm.path, state_root, topology=arm.topology)
    try:
        state = start_detached(run, timeout_s, on_change=progress.on_change)
    except StartupError as exc:
        raise StartupError(f"arm `{arm.name}` did not start: {exc}") from None
    finally:
        progress.done_starting()
    result = ArmRun(arm, [{"name": s.name, "role": s.role, "gpus": list(s.gpus)}
                          for s in state.engines])
    try:
        headers = _headers(state)
        url = state.proxy.url
        progress.line(f"  {arm.name}: ready at {url}; greedy subset ({len(prompts)} prompts)")
        result.greedy = [send_chat(url, chat_body(p, state.model_name), headers)
                         for p in prompts]
        # Store counters exist for epdctl's own store only (another connector: none shown).
        is_ours = "encode" in arm.topology.roles and state.is_our_store
        ns_dir = Path(state.store_dir) if is_ours else None
        for index in range(len(workload.points)):
            result.points.append(_run_point(arm, workload, index, state, work_dir, datasets,
                                            ns_dir, progress, earlier))
    finally:
        progress.line(f"  {arm.name}: stopping")
        try:
            state = run.sdir.read()  # the supervisor's latest (restarts, pids)
        except EpdctlError:
            pass
        stop(run.sdir, state)
    return result


def _headers(state: RunState) -> dict[str, str]:
    key = state.proxy_api_key
    return {"authorization": f"Bearer {key}"} if key else {}


def _estimate(workload: Workload, index: int, earlier: Sequence[ArmRun]) -> float | None:
    """What the point took on an earlier arm, else num_prompts / rate (None: unknown)."""
    for run in reversed(earlier):
        if index < len(run.points):
            return run.points[index].elapsed_s
    rate = workload.points[index].request_rate
    return None if math.isinf(rate) else workload.num_prompts / rate


def _run_point(arm: Arm, workload: Workload, index: int, state: RunState, work_dir: Path,
               datasets: Mapping[int, Path], ns_dir: Path | None, progress: Progress,
               earlier: Sequence[ArmRun]) -> PointRun:
    point = workload.points[index]
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    name = f"{arm.name}-{index}"
    result_path = runs_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    args = argv(bench_command(arm), workload, index, url=state.proxy.url,
                model=arm.topology.model, served_model_name=state.model_name,
                result_dir=runs_dir, result_name=result_path.name, dataset=datasets.get(index))
    estimate = _estimate(workload, index, earlier)
    what = f"  {arm.name}: load point {index + 1}/{len(workload.points)} ({point.label})"
    progress.line(f"{what}, {workload.num_prompts} requests")
    proxy_before = proxy_counters(state)
    store_before = _store(ns_dir)
    start = time.monotonic()
    log_path = runs_dir / f"{name}.log"
    code = _run_bench(args, log_path, _env(arm, state), lambda: progress.tick(
        f"{what}: {_clock(time.monotonic() - start)} / "
        f"{'~' + _clock(estimate) if estimate else '?'}"))
    elapsed = time.monotonic() - start
    if code != 0 or not result_path.exists():
        raise BenchError(f"`vllm bench serve` against `{arm.name}` exited with code {code}; "
                         f"last lines of {log_path}:\n{_tail(log_path)}")
    figures = parse_result(result_path)
    store = None if ns_dir is None else _store_delta(store_before, ns_dir)
    proxy = proxy_delta(proxy_before, proxy_counters(state))
    progress.line(f"{what}: done in {_clock(elapsed)}, {figures['completed']} completed, "
                  f"{figures['failed']} failed")
    return PointRun(index, args, figures, proxy, store, elapsed)


def _clock(seconds: float | None) -> str:
    """Whole seconds, as a stopwatch counts them (59.7 s is `59s`, then `1m00s`)."""
    if seconds is None:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _env(arm: Arm, state: RunState) -> dict[str, str]:
    """Ours, the topology's Hugging Face settings (offline, cache), the proxy's key."""
    env = {**os.environ, **{k: v for k, v in arm.topology.engine.env.items()
                            if k.startswith(("HF_", "TRANSFORMERS_"))}}
    if state.proxy_api_key:
        env["OPENAI_API_KEY"] = state.proxy_api_key  # what `vllm bench serve` sends
    return env


def _run_bench(args: Sequence[str], log_path: Path, env: Mapping[str, str],
               tick: Callable[[], None]) -> int:
    """Run it in a session of its own (Ctrl+C is ours to handle); stop it on any exit."""
    # Never through a link planted at its name (O_NOFOLLOW): ELOOP instead.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env),
                                start_new_session=True)
    try:
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                tick()
    finally:
        if proc.poll() is None:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "  (no log)"
    return "\n".join(f"  {line}" for line in lines[-LOG_TAIL_LINES:])


def proxy_counters(state: RunState) -> dict[str, float] | None:
    """The proxy's /metrics counters bench reports (None: it has no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        reply = httpx.get(f"{state.proxy.url}/metrics", headers=_headers(state), timeout=10.0)
        if reply.status_code != 200:
            return None
        families = list(text_string_to_metric_families(reply.text))
    except (httpx.HTTPError, ValueError):
        return None
    counts: dict[str, float] = dict.fromkeys(
        ("encode_sum", "encode_count", "fallbacks", "retries", "requests_ok", "requests_failed"),
        0.0)
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("epdctl_proxy_stage_seconds_") and \
                    labels.get("stage") == "encode" and sample.name.endswith(("_sum", "_count")):
                counts[f"encode_{sample.name.rsplit('_', 1)[1]}"] += sample.value
            elif sample.name == "epdctl_proxy_fallbacks_total":
                counts["fallbacks"] += sample.value
            elif sample.name == "epdctl_proxy_retries_total":
                counts["retries"] += sample.value
            elif sample.name == "epdctl_proxy_requests_total":
                counts["requests_ok" if labels.get("outcome") == "ok" else "requests_failed"] \
                    += sample.value
    return counts


def proxy_delta(before: dict[str, float] | None, after: dict[str, float] | None
                ) -> dict[str, float | None]:
    """Encode-stage mean time, fallbacks, retries and outcomes while one point ran."""
    keys = ("fallbacks", "retries", "requests_ok", "requests_failed")
    if before is None or after is None:
        return {"encode_mean_ms": None, **dict.fromkeys(keys)}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in (*keys, "encode_sum", "encode_count")}
    count = delta.pop("encode_count")
    total = delta.pop("encode_sum")
    mean = round(total / count * 1000.0, 3) if count else None
    return {"encode_mean_ms": mean, **{k: int(v) for k, v in delta.items()}}


def _store(ns_dir: Path | None) -> tuple[Counter[str], Counter[str]] | None:
    """The store's counters once they stop changing (engines flush them each second)."""
    from epdctl.cache.stats import read_stats

    if ns_dir is None:
        return None
    deadline = time.monotonic() + STATS_WAIT_S
    now = read_stats(ns_dir)
    while time.monotonic() < deadline:
        time.sleep(STATS_SETTLE_S)
        again = read_stats(ns_dir)
        if again == now:
            break
        now = again
    return now


def _store_delta(before: tuple[Counter[str], Counter[str]] | None,
                 ns_dir: Path) -> dict[str, int]:
    """Store counters while one point ran: saves (E), hits and misses (P/PD lookups), the
    distinct images loaded, and hits on an image already hit during the point."""
    now = _store(ns_dir)
    assert before is not None and now is not None
    counts = now[0] - before[0]
    keys = len(now[1] - before[1])  # per-key counts: lookups and loads of each image
    hits = int(counts["hits"])
    return {"saves": int(counts["saves"]), "hits": hits, "misses": int(counts["misses"]),
            "keys_hit": keys, "repeat_hits": max(hits - keys, 0),
            "load_failures": int(counts["load_failures"])}


def device_names(arms: Sequence[Arm]) -> list[str]:
    """NVML names of the GPUs (cuda), else the CPU's model name."""
    if arms and arms[0].topology.device == "cuda":
        from epdctl.gpus import gpu_names

        try:
            return gpu_names()
        except EpdctlError:
            return []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return [f"{line.partition(':')[2].strip()} ({os.cpu_count()} CPUs)"]
    except OSError:
        pass
    import platform

    return [platform.processor() or platform.machine()]
