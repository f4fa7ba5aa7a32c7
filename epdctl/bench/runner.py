"""Bring each arm up through the run API, run the workload against it, take it down."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from epdctl.bench.arms import Arm
from epdctl.bench.audio import write_audio_dataset
from epdctl.bench.counters import (
    _headers,
    _store,
    _store_delta,
    proxy_counters,
    proxy_delta,
)
from epdctl.bench.samples import Round, parse_round
from epdctl.bench.schedule import clock, round_order, time_left
from epdctl.bench.senders import KINDS, argv, estimate_s, write_mix
from epdctl.bench.workload import Workload, parse_result, write_dataset
from epdctl.errors import BenchError, EpdctlError, StartupError
from epdctl.host.interrupts import unwinding
from epdctl.launch.state import RunState
from epdctl.traces.classes import describe
from epdctl.verifier.prompts import PROMPTS, ChatAnswer, Prompt, chat_body, send_chat

POLL_S = 1.0
LOG_TAIL_LINES = 15


class Progress(Protocol):
    """Where the runner reports what it is doing (the CLI prints it on stderr)."""

    def line(self, text: str) -> None: ...
    def tick(self, text: str) -> None: ...
    def on_change(self, state: RunState) -> None: ...
    def done_starting(self) -> None: ...


@dataclass
class PointRun:
    """One load point against one arm, in one round."""

    index: int
    argv: list[str]
    figures: dict[str, float | int | None]
    proxy: dict[str, float | None]
    store: dict[str, int] | None
    elapsed_s: float
    round: int = 0
    samples: Round | None = None
    """Its completed requests (None: a result without per-request data)."""
    seq: int = 0
    """Its place in the whole bench's run order."""
    start: int = 0
    """Which start of its arm it ran on (0: the first; a round the arm stayed up for shares
    the start of the round before)."""


@dataclass
class ArmRun:
    arm: Arm
    instances: list[dict[str, Any]] = field(default_factory=list)
    greedy: list[ChatAnswer] = field(default_factory=list)
    points: list[PointRun] = field(default_factory=list)
    starts: int = 0
    """How often it was brought up (an arm that runs last in one round and first in the
    next stays up)."""
    start_s: list[float] = field(default_factory=list)
    """How long each start took (ready, the greedy subset the first time, the warm-up)."""


@dataclass(frozen=True)
class Plan:
    """How often, and how, each arm is measured."""

    rounds: int = 1
    warmup: int = 0
    """Requests sent after each start, at the first load point's load, not counted."""
    max_rounds: int | None = None
    """--until-significant: add rounds up to this many while `undecided` says so."""


def greedy_prompts(limit: int | None, modalities: frozenset[str] = frozenset({"image"}),
                   audio_limit: int | None = None) -> list[Prompt]:
    """verify's fixed prompts that fit the arms' image limit and take only `modalities`
    (images alone by default; an audio model's arms: audio, within `audio_limit`)."""
    return [p for p in PROMPTS if p.modalities <= modalities
            and (limit is None or len(p.images) <= limit)
            and (audio_limit is None or len(p.audios) <= audio_limit)
            and not p.videos]


def prompts_for_arms(arms: Sequence[Arm]) -> list[Prompt]:
    """The greedy subset every arm takes: images (within the image limit) or, where the arms
    take audio and no images (an audio model), audio clips (within the audio limit)."""
    from epdctl.bench.arms import image_limit
    from epdctl.verifier.prompts import taken_modalities

    def least(modality: str) -> int | None:
        limits = [n for n in (image_limit(a.topology, modality) for a in arms) if n is not None]
        return min(limits) if limits else None

    taken = frozenset.intersection(*(frozenset(taken_modalities(a.topology.engine.args))
                                     for a in arms))
    if "audio" in taken and "image" not in taken:
        return greedy_prompts(None, frozenset({"audio"}), least("audio"))
    return greedy_prompts(least("image"))


@dataclass
class _Up:
    """The arm that is up now."""

    arm: Arm
    run: Any
    state: RunState
    ns_dir: Path | None


@unwinding()  # SIGTERM and SIGHUP too take the arm that is up down
def run_arms(arms: Sequence[Arm], workload: Workload, state_root: Path, work_dir: Path, *,
             timeout_s: float, progress: Progress, prompts: Sequence[Prompt],
             plan: Plan = Plan(),
             undecided: Callable[[Sequence[ArmRun]], bool] = lambda runs: False,
             wanted: Callable[[int, Sequence[PointRun]], bool] = lambda index, done: True
             ) -> list[ArmRun]:
    """Every round, the arms in alternating order; an arm goes down before the next one
    starts (and on any error). After `plan.rounds`, more rounds while `undecided(runs)`, up
    to `plan.max_rounds`. A load point is run only if `wanted(index, done)` (done: the
    arm's points of this round so far), so that a search over load points can skip those
    it no longer needs."""
    runs = {arm.name: ArmRun(arm) for arm in arms}
    datasets: dict[tuple[int, int], Path] = {}
    up: _Up | None = None
    seq = 0
    round_ = 0
    try:
        while round_ < plan.rounds or (plan.max_rounds is not None and round_ < plan.max_rounds
                                       and undecided(list(runs.values()))):
            datasets.update(_datasets(workload, work_dir, progress, round_))
            order = round_order(arms, round_)
            progress.line(f"round {round_ + 1}: {' '.join(a.name for a in order)}"
                          + _to_go(arms, runs, workload, plan, round_))
            for arm in order:
                if up is None or up.arm is not arm:
                    if up is not None:
                        _stop(up, progress)
                        up = None
                    began = time.monotonic()
                    up = _start(arm, runs[arm.name], workload, state_root, work_dir, plan,
                                timeout_s, progress, prompts, arms)
                    runs[arm.name].start_s.append(time.monotonic() - began)
                done: list[PointRun] = []
                for index in range(len(workload.points)):
                    if not wanted(index, done):
                        continue
                    seq += 1
                    point = _run_point(arm, workload, index, up.state, work_dir, datasets,
                                       up.ns_dir, progress, list(runs.values()), round_)
                    point.seq = seq
                    point.start = runs[arm.name].starts - 1
                    runs[arm.name].points.append(point)
                    done.append(point)
            round_ += 1
    finally:
        if up is not None:
            _stop(up, progress)
    return list(runs.values())


def _to_go(arms: Sequence[Arm], runs: Mapping[str, ArmRun], workload: Workload, plan: Plan,
           round_: int) -> str:
    """From the second round: about how long the planned rounds left take (an extra round
    of --until-significant: this one), from the starts and load points already run."""
    if not round_:
        return ""
    until = max(plan.rounds, round_ + 1)
    point_s = {(name, p.index): p.elapsed_s for name, run in runs.items()
               for p in sorted(run.points, key=lambda p: p.seq)}
    left = time_left([a.name for a in arms], until, round_,
                     {name: run.start_s for name, run in runs.items()}, point_s,
                     len(workload.points))
    if left is None:
        return ""
    return f" (about {clock(left)} {'to go' if round_ < plan.rounds else 'more'}, as the " \
        "earlier rounds took)"


def _datasets(workload: Workload, work_dir: Path, progress: Progress, round_: int
              ) -> dict[tuple[int, int], Path]:
    if workload.kind not in ("generated", "audio", "mix"):
        return {}
    paths = {}
    for index in range(len(workload.points)):
        suffix = f"-r{round_ + 1}" if round_ else ""
        path = work_dir / "datasets" / f"point-{index}{suffix}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if workload.kind == "mix":
            trace = write_mix(workload, index, path, round_)
            progress.line(f"trace {path}: {describe(trace.requests)}")
        elif workload.kind == "audio":
            counts = write_audio_dataset(workload, workload.seed_at(index, round_),
                                         workload.requests_at(index), path)
            progress.line(f"dataset {path}: {counts['audios']} audio clips")
        else:
            counts = write_dataset(workload, index, path, round_)
            progress.line(f"dataset {path}: {counts['images']} images, "
                          f"{counts['repeated_images']} of them repeats")
        paths[(round_, index)] = path
    return paths


def _start(arm: Arm, result: ArmRun, workload: Workload, state_root: Path, work_dir: Path,
           plan: Plan, timeout_s: float, progress: Progress, prompts: Sequence[Prompt],
           arms: Sequence[Arm]) -> _Up:
    """Bring the arm up; the greedy subset the first time, the warm-up every time."""
    from epdctl.launch.run import prepare, start_detached

    progress.line(f"[{list(arms).index(arm) + 1}/{len(arms)}] {arm.name}: starting "
                  f"{arm.topology.name} ({arm.topology.mode})")
    run = prepare(arm.path, state_root, topology=arm.topology)
    try:
        state = start_detached(run, timeout_s, on_change=progress.on_change)
    except StartupError as exc:
        raise StartupError(f"arm `{arm.name}` did not start: {exc}") from None
    finally:
        progress.done_starting()
    # Store counters exist for epdctl's own store only (another connector: none shown).
    is_ours = "encode" in arm.topology.roles and state.is_our_store
    up = _Up(arm, run, state, Path(state.store_dir) if is_ours else None)
    try:
        result.starts += 1
        url = state.proxy.url
        if not result.instances:
            result.instances = [{"name": s.name, "role": s.role, "gpus": list(s.gpus)}
                                for s in state.engines]
            progress.line(f"  {arm.name}: ready at {url}; greedy subset ({len(prompts)} "
                          "prompts)")
            result.greedy = [send_chat(url, chat_body(p, state.model_name), _headers(state))
                             for p in prompts]
        if plan.warmup:
            _warm_up(arm, workload, state, work_dir, plan.warmup, progress, result.starts)
    except BaseException:
        _stop(up, progress)
        raise
    return up


def _stop(up: _Up, progress: Progress) -> None:
    from epdctl.launch.run import stop

    progress.line(f"  {up.arm.name}: stopping")
    state = up.state
    try:
        state = up.run.sdir.read()  # the supervisor's latest (restarts, pids)
    except EpdctlError:
        pass
    stop(up.run.sdir, state)


def _warm_up(arm: Arm, workload: Workload, state: RunState, work_dir: Path, count: int,
             progress: Progress, start: int) -> None:
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    name = f"{arm.name}-warmup-{start}"
    dataset = None
    if workload.kind in ("audio", "mix"):  # of its own, as the warm-up's images are
        dataset = work_dir / "datasets" / f"{name}.jsonl"
        dataset.parent.mkdir(parents=True, exist_ok=True)
        if workload.kind == "mix":
            write_mix(workload, 0, dataset, count=count, seed=workload.warmup_seed())
        else:
            write_audio_dataset(workload, workload.warmup_seed(), count, dataset)
    args = argv(arm, workload, 0, url=state.proxy.url,
                model=arm.topology.model, served_model_name=state.model_name, result_dir=runs_dir,
                result_name=f"{name}.json", dataset=dataset, warmup=count)
    progress.line(f"  {arm.name}: warm-up, {count} requests (not counted)")
    log_path = runs_dir / f"{name}.log"
    code = _run_bench(args, log_path, _env(arm, state), lambda: None)
    if code != 0:
        raise BenchError(f"`{_sender(workload)}` against `{arm.name}` exited with code "
                         f"{code} in the warm-up; "
                         f"last lines of {log_path}:\n{_tail(log_path)}")


def _estimate(workload: Workload, index: int, earlier: Sequence[ArmRun]) -> float | None:
    """What the point took last (any arm, any round), else its requests / rate (None:
    unknown)."""
    done = [p for run in earlier for p in run.points if p.index == index]
    if done:
        return sorted(done, key=lambda p: p.seq)[-1].elapsed_s
    if workload.trace is not None:
        return estimate_s(workload, index)
    rate = workload.points[index].request_rate
    return None if math.isinf(rate) else workload.requests_at(index) / rate


def _run_point(arm: Arm, workload: Workload, index: int, state: RunState, work_dir: Path,
               datasets: Mapping[tuple[int, int], Path], ns_dir: Path | None,
               progress: Progress, earlier: Sequence[ArmRun], round_: int = 0) -> PointRun:
    point = workload.points[index]
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    name = f"{arm.name}-{index}" + (f"-r{round_ + 1}" if round_ else "")
    result_path = runs_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    args = argv(arm, workload, index, url=state.proxy.url,
                model=arm.topology.model, served_model_name=state.model_name,
                result_dir=runs_dir, result_name=result_path.name,
                dataset=datasets.get((round_, index)), round_=round_)
    estimate = _estimate(workload, index, earlier)
    what = (f"  {arm.name}: load point {index + 1}/{len(workload.points)} ({point.label})"
            + (f", round {round_ + 1}" if round_ else ""))
    progress.line(f"{what}, {workload.requests_at(index)} requests")
    proxy_before = proxy_counters(state)
    store_before = _store(ns_dir)
    start = time.monotonic()
    log_path = runs_dir / f"{name}.log"
    code = _run_bench(args, log_path, _env(arm, state), lambda: progress.tick(
        f"{what}: {clock(time.monotonic() - start)} / "
        f"{'~' + clock(estimate) if estimate else '?'}"))
    elapsed = time.monotonic() - start
    if code != 0 or not result_path.exists():
        raise BenchError(f"`{_sender(workload)}` against `{arm.name}` exited with code {code}; "
                         f"last lines of {log_path}:\n{_tail(log_path)}")
    figures = parse_result(result_path)
    try:
        samples: Round | None = parse_round(json.loads(result_path.read_text()), workload.slo)
    except (BenchError, ValueError):
        samples = None
    store = None if ns_dir is None else _store_delta(store_before, ns_dir)
    proxy = proxy_delta(proxy_before, proxy_counters(state))
    progress.line(f"{what}: done in {clock(elapsed)}, {figures['completed']} completed, "
                  f"{figures['failed']} failed")
    return PointRun(index, args, figures, proxy, store, elapsed, round_, samples)


def _sender(workload: Workload) -> str:
    return "epdctl.bench.replay" if workload.kind in KINDS else "vllm bench serve"


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
