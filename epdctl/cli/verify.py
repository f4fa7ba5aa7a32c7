"""`epdctl verify`: the topology's answers equal an aggregated baseline's, with EC cache hits."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from epdctl.cli._app import App, pass_app
from epdctl.host.interrupts import unwinding
from epdctl.launch.readiness import STARTUP_TIMEOUT_S

if TYPE_CHECKING:
    from epdctl.launch.processes import Proc
    from epdctl.launch.spec import LaunchSpec
    from epdctl.launch.state import RunState, StateDir
    from epdctl.topology.model import Topology
    from epdctl.verifier.probes import Probe, Result, Target


def _specs(app: App, topology_path: Path, topology: Topology, sdir: StateDir
           ) -> list[LaunchSpec]:
    """The running (else the planned) instances: the baseline mirrors the PD/prefill one."""
    from epdctl.launch.run import prepare

    if sdir.is_running():
        return [s.spec() for s in sdir.read().specs]
    return list(prepare(topology_path, app.state_root, topology=topology).plan.specs)


def _up(app: App, topology_path: Path, topology: Topology, timeout_s: float) -> RunState:
    """Start the topology detached; progress and summary on stderr (stdout is the report's)."""
    from epdctl.cli.views import Progress, summary
    from epdctl.launch.run import prepare, start_detached

    run = prepare(topology_path, app.state_root, topology=topology)
    progress = Progress(app)
    try:
        state = start_detached(run, timeout_s, on_change=progress.update)
    finally:
        progress.close()
    app.err.print(summary(state))
    return state


def _stop_topology(app: App, sdir: StateDir) -> None:
    from epdctl.launch.run import stop

    state = sdir.read()
    app.err.print(f"Stopping {state.name} (verify started it; --keep leaves it running)",
                  markup=False)
    stop(sdir, state)


@click.command()
@click.argument("topology_path", metavar="TOPOLOGY", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout.")
@click.option("--baseline-url", "baseline_url", metavar="URL",
              help="An aggregated server of the same model to compare with; default: start one "
              "like the PD/prefill instance, without EC/KV transfer (device: cpu).")
@click.option("--baseline-gpus", "baseline_gpus", metavar="LIST",
              help="device: cuda: free GPUs (e.g. 6,7) to start the baseline on.")
@click.option("--keep", "should_keep", is_flag=True,
              help="Leave the topology running when verify started it.")
@click.option("--timeout", "timeout_s", type=float, default=STARTUP_TIMEOUT_S,
              show_default=True,
              help="Seconds the topology and the baseline get to become ready.")
@pass_app
@unwinding()  # SIGTERM and SIGHUP too stop what verify started
def verify(app: App, topology_path: Path, as_json: bool, baseline_url: str | None,
           baseline_gpus: str | None, should_keep: bool, timeout_s: float) -> None:
    """Check a topology's answers against an aggregated baseline, with EC cache hits"""
    from epdctl.launch.run import require_ready
    from epdctl.launch.state import StateDir
    from epdctl.topology.model import load_topology, require_local_model
    from epdctl.verifier import baseline as base
    from epdctl.verifier.probes import report

    topology = load_topology(topology_path)
    require_local_model(topology)
    sdir = StateDir(app.state_dir(topology.name))
    deadline = time.monotonic() + timeout_s
    # The baseline options are checked before anything starts.
    model = base.first_model(baseline_url) if baseline_url else None
    gpus = None if baseline_url else base.parse_gpus(topology.device, baseline_gpus)
    baseline: tuple[LaunchSpec, Proc] | None = None
    is_started = False
    is_running = sdir.is_running()
    if is_running:
        require_ready(sdir)
    try:
        if baseline_url is None:
            baseline = base.start(_specs(app, topology_path, topology, sdir), sdir.path, gpus)
            app.err.print(f"Starting the baseline on port {baseline[0].port} "
                          f"(log {baseline[0].log_path})", markup=False)
        if is_running:
            app.err.print(f"{topology.name} is running already: verifying it", markup=False)
        else:
            _up(app, topology_path, topology, timeout_s)
            is_started = True
        state = sdir.read()
        if baseline is not None:
            base.wait_ready(*baseline, deadline, timeout_s)
            baseline_url = baseline[0].url
        assert baseline_url is not None
        mine, theirs = _targets(state, baseline_url, model)
        probe, results = _run_prompts(app, topology, state, mine, theirs)
    finally:
        if baseline is not None:
            base.stop(*baseline, sdir.path)
        if is_started and not should_keep:
            _stop_topology(app, sdir)
    check = _cache_check(probe, "encode" in topology.roles)
    meta: dict[str, Any] = {
        "name": state.name, "mode": state.mode, "model": state.model_name,
        "ec_connector": state.ec_connector, "cache_check": check,
        "proxy_url": mine.url, "started_topology": is_started,
        "kept": is_started and should_keep,
        "baseline": {"url": theirs.url, "model": theirs.model,
                     "pid": baseline[1].pid if baseline else None,
                     "log": str(baseline[0].log_path) if baseline else None},
    }
    _finish(app, report(results, **meta), results, check, state, as_json)


def _targets(state: RunState, baseline_url: str, model: str | None) -> tuple[Target, Target]:
    """The topology's proxy (with its API key) and the baseline, each with its model."""
    from epdctl.cli.views import proxy_url
    from epdctl.verifier import baseline as base
    from epdctl.verifier.probes import Target

    key = state.proxy_api_key
    mine = Target(proxy_url(state), state.model_name,
                  {"authorization": f"Bearer {key}"} if key else {})
    theirs = Target(baseline_url, model or base.first_model(baseline_url))
    return mine, theirs


def _run_prompts(app: App, topology: Topology, state: RunState, mine: Target, theirs: Target
                 ) -> tuple[Probe | None, list[Result]]:
    """Send the prompts to both, one line on stderr each; the EC probe that watched them."""
    from epdctl.verifier.probes import probe_for, run_prompts
    from epdctl.verifier.prompts import prompts_for, taken_modalities

    probe = probe_for(state.ec_connector, Path(state.store_dir)) \
        if "encode" in topology.roles else None
    app.err.print(f"Sending the prompts to {mine.url} and {theirs.url}", markup=False)
    # Every modality the answering engines let in (--limit-mm-per-prompt), and only
    # those: a modality the model does not take is vLLM's 400.
    final = topology.roles.get("prefill_decode") or topology.roles.get("decode")
    taken = taken_modalities([*topology.engine.args, *(final.args if final else [])])
    results = run_prompts(
        mine, theirs, probe, prompts_for(taken), on_result=lambda r: app.err.print(
            f"  {r.prompt.name}: {'ok' if r.is_ok else 'FAILED'}", markup=False))
    return probe, results


def _finish(app: App, doc: dict[str, Any], results: Sequence[Result], check: str | None,
            state: RunState, as_json: bool) -> None:
    """Print the report; raise VerifyError unless every answer was equal and the EC transfer
    was seen (when it can be)."""
    from epdctl.cli._verify_render import mismatches, verify_table
    from epdctl.errors import VerifyError

    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        app.out.print(verify_table(results))
        app.out.print(mismatches(results), end="")
    bad = [r.prompt.name for r in results if not r.is_ok]
    if bad:
        raise VerifyError(f"{len(bad)} of {len(results)} prompts failed: {', '.join(bad)}")
    if not doc["ok"]:
        raise VerifyError("no image was loaded from the EC store: P/PD did not use E's output"
                          if check == "store" else f"E saved no image file for "
                          f"{state.ec_connector}: P/PD did not get E's output")
    line = _cache_line(state, results, check)
    app.err.print(f"{len(results)} prompts equal to the baseline{line}", markup=False)


def _cache_check(probe: Probe | None, has_encoder: bool) -> str | None:
    """What verify checked of the EC transfer: `store` counters, `files`, or `none`."""
    from epdctl.verifier.probes import FileProbe, StoreProbe

    if not has_encoder:
        return None
    if isinstance(probe, StoreProbe):
        return "store"
    return "files" if isinstance(probe, FileProbe) else "none"


def _cache_line(state: RunState, results: Sequence[Result], check: str | None) -> str:
    """The end of verify's last line: what the EC transfer check showed."""
    uses = [r.cache for r in results if r.cache is not None]
    with_images = sum(1 for r in results if r.prompt.modalities)
    if check == "none" and with_images:
        return (f"; EC cache use not verified: {state.ec_connector} keeps nothing epdctl can "
                "read (equal answers are all this shows)")
    if check == "files" and uses:
        return (f"; {sum(u.verdict == 'saved' for u in uses)} of {len(uses)} with images found "
                f"in {state.ec_connector}'s files (whether P/PD loaded them cannot be seen: "
                "the connector records no loads)")
    if not uses:
        return ""
    return (f"; {sum(u.verdict == 'hit' for u in uses)} of {len(uses)} with images loaded "
            "them from the EC store")
