"""`epdctl doctor`: check what `up` needs of this machine, one line per check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app

if TYPE_CHECKING:
    from epdctl.doctor import Check

_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
_NAME_WIDTH = 13


def _line(check: Check) -> Text:
    text = Text()
    text.append(f"{check.status:<5} ", style=_STYLES[check.status])
    text.append(f"{check.name:<{_NAME_WIDTH}} ")
    text.append(check.detail)
    if check.fix:
        text.append(f"\n{'':<{_NAME_WIDTH + 7}}fix: {check.fix}", style="dim")
    return text


def _summary(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail", "skip")}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n)


@click.command()
@click.argument("topology_path", metavar="[TOPOLOGY]", required=False,
                type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help='Machine-readable: {"ok": bool, "checks": [{name, status, detail, fix}]}.')
@click.pass_context
@pass_app
def doctor(app: App, ctx: click.Context, topology_path: Path | None, as_json: bool) -> None:
    """Check that this machine can run a topology; start nothing

    One line per check: ok, warn, fail or skip, with the fix. Exit 1 when any check fails.
    Without TOPOLOGY, the environment alone: vllm, plugin, gpus and ec-store (/dev/shm).

    \b
    vllm          the engine command answers `--version` in place of `serve`
                  (`vllm` on PATH; `device: cpu`: python -m epdctl.engines.vllm_cpu),
                  a version epdctl supports
    plugin        the `epdctl_ec` vllm.general_plugins entry point loads in the
                  engine's Python (checked there, in a subprocess)
    kv-connector  P|D: the KV connector's package imports there (NixlConnector: nixl)
    ec-connector  cache.connector imports there: Mooncake's or NIXL's package, or your
                  module.path:ClassName (imported, the class looked up)
    gpus          NVML lists the visible GPUs, names and free memory
    placement     the roles fit them: GPU indices, replicas x tensor_parallel, shared
                  fractions; `device: cpu`: the cores each instance is bound to
    gpu-memory    each GPU has its instances' gpu_memory_utilization free now
                  (vLLM's default, 0.92, where a role sets none)
    ec-store      cache.dir is writable, on tmpfs, and holds cache.capacity (epdctl's
                  store; ECExampleConnector: no budget)
    ports         every planned port (instances, NIXL side channels, proxy) is free
    model         a local path holds config.json; a hub id is in the Hugging Face
                  cache (fail under HF_HUB_OFFLINE, else a warning: up downloads it)
    combination   settings that validate but do not work: MooncakeConnector, kv: with
                  no P|D split, an open proxy with no api_key, Qwen3.5 over NIXL
                  without VLLM_SSM_CONV_STATE_LAYOUT=DS
    safety        what other users of the machine can do: the engines' key (always),
                  where the EC store is and that it is private, who may use the proxy
                  (warn: a literal proxy.api_key in a file others can read; fail: a key
                  file or ${VAR} that cannot be read)
    """
    from epdctl.doctor import run_checks
    from epdctl.topology.model import load_topology

    topology = None
    if topology_path is not None:
        topology = load_topology(topology_path)
    if app.err.is_interactive and not as_json:
        with app.err.status("checking (vLLM's --version takes a few seconds)"):
            checks = run_checks(topology, app.state_root, topology_path=topology_path)
    else:
        checks = run_checks(topology, app.state_root, topology_path=topology_path)
    is_ok = all(c.status != "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": is_ok, "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        for check in checks:
            app.out.print(_line(check))
        app.err.print(_summary(checks), markup=False)
    ctx.exit(0 if is_ok else 1)
