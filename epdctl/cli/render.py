"""`epdctl render k8s`: the topology as Kubernetes manifests."""

from __future__ import annotations

import re
from pathlib import Path

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.render.k8s import DEFAULT_IMAGE

# Kept here rather than imported so `--help` does not load the planner.
# E|PD: Mooncake (the proxy speaks its transfer-id protocol). E|P|D: Mooncake's consumer
# routing does not cover P|D, so ECCPUConnector (NIXL pull; the proxy forwards E's params).
EC_CONNECTOR_E_PD = "ECMooncakeConnector"
EC_CONNECTOR_E_P_D = "ECCPUConnector"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _DNS_LABEL.match(value):
        raise click.BadParameter("must be a DNS label: lower-case letters, digits and dashes")
    return value


@click.group()
def render() -> None:
    """Write the topology out for running somewhere other than this machine"""


@render.command()
@click.argument("topology_path", metavar="TOPOLOGY", type=click.Path(path_type=Path))
@click.option("-o", "--output-dir", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write one file per object here instead of one stream to stdout.")
@click.option("--namespace", callback=_namespace,
              help="Set metadata.namespace (default: none, so `kubectl -n` decides).")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True,
              help="Container image for engines and proxy; it must include epdctl.")
@click.option("--ec-connector",
              help=f"vLLM EC connector that moves encoder outputs between pods "
              f"[default: {EC_CONNECTOR_E_PD} for E|PD, {EC_CONNECTOR_E_P_D} for E|P|D].")
@click.option("--gpus-per-node", type=click.IntRange(min=1),
              help="GPUs per node; a role with more tensor_parallel becomes a LeaderWorkerSet "
              "spanning nodes.")
@pass_app
def k8s(
    app: App,
    topology_path: Path,
    out_dir: Path | None,
    namespace: str | None,
    image: str,
    ec_connector: str | None,
    gpus_per_node: int | None,
) -> None:
    """Render Kubernetes manifests (StatefulSets, Services, proxy, ConfigMap) for TOPOLOGY

    \b
    epdctl render k8s topologies/qwen2_5-vl-1e1pd.yaml | kubectl apply -f -
    epdctl render k8s topology.yaml -o manifests/ --namespace epd
    """
    from epdctl.render import K8sOptions, render_k8s
    from epdctl.render._yaml import dump_all, write_dir
    from epdctl.topology import load_topology

    topology = load_topology(topology_path)
    if ec_connector is None:
        is_split = "prefill" in topology.roles
        ec_connector = EC_CONNECTOR_E_P_D if is_split else EC_CONNECTOR_E_PD
    text = topology_path.read_text(encoding="utf-8")
    options = K8sOptions(namespace=namespace, image=image, ec_connector=ec_connector,
                         gpus_per_node=gpus_per_node)
    rendering = render_k8s(topology, text, options)
    if out_dir is None:
        click.echo(dump_all(rendering, topology_path.name), nl=False)
    else:
        written = write_dir(rendering, topology_path.name, out_dir)
        app.err.print(Text(f"wrote {len(written)} files to {out_dir}"))
    for note in rendering.notes:
        app.err.print(Text("note: ", style="yellow") + Text(note))
