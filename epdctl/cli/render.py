"""`epdctl render k8s`: the topology as Kubernetes manifests."""

from __future__ import annotations

import re
from pathlib import Path

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.render.options import DEFAULT_IMAGE, HF_TOKEN_KEY

# Kept here rather than imported so `--help` does not load the planner.
# E|PD: Mooncake (the proxy speaks its transfer-id protocol). E|P|D: Mooncake's consumer
# routing does not cover P|D, so ECCPUConnector (NIXL pull; the proxy forwards E's params).
EC_CONNECTOR_E_PD = "ECMooncakeConnector"
EC_CONNECTOR_E_P_D = "ECCPUConnector"
NETWORK_CONNECTORS = (EC_CONNECTOR_E_PD, EC_CONNECTOR_E_P_D)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


def _namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _DNS_LABEL.match(value):
        raise click.BadParameter("must be a DNS label: lower-case letters, digits and dashes")
    return value


def _object_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _DNS_SUBDOMAIN.match(value):
        raise click.BadParameter("must be a Kubernetes object name: lower-case letters, "
                                 "digits, dashes and dots")
    return value


def _pod_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise click.BadParameter(f"must be an absolute path, not {value!r}")
    return value


def _secret(ctx: click.Context, param: click.Parameter, value: str | None
            ) -> tuple[str, str] | None:
    if value is None:
        return None
    name, _, key = value.partition(":")
    _object_name(ctx, param, name)
    if not _SECRET_KEY.match(key or HF_TOKEN_KEY):
        raise click.BadParameter(f"KEY must be letters, digits, '-', '_' or '.', not {key!r}")
    return name, key or HF_TOKEN_KEY


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
              f"[default: the topology's cache.connector if it is one of "
              f"{', '.join(NETWORK_CONNECTORS)}, else {EC_CONNECTOR_E_PD} for E|PD, "
              f"{EC_CONNECTOR_E_P_D} for E|P|D].")
@click.option("--gpus-per-node", type=click.IntRange(min=1),
              help="GPUs per node; a role with more tensor_parallel becomes a LeaderWorkerSet "
              "spanning nodes.")
@click.option("--model-pvc", metavar="NAME", callback=_object_name,
              help="PersistentVolumeClaim holding the model, for a `model:` that is an "
              "absolute path in the pods; mounted read-only at that path's directory "
              "(or --model-mount).")
@click.option("--model-host-path", metavar="DIR", callback=_pod_dir,
              help="Directory on every GPU node holding the model (hostPath), instead of "
              "--model-pvc; mounted the same way.")
@click.option("--model-mount", metavar="DIR", callback=_pod_dir,
              help="Where the model volume is mounted in the pods; `model:` must be inside it "
              "[default: the directory of `model:`].")
@click.option("--hf-cache-pvc", metavar="NAME", callback=_object_name,
              help="PersistentVolumeClaim for the Hugging Face cache (HF_HOME), shared by the "
              "engine pods [default for a hub model: an emptyDir, so every pod downloads it].")
@click.option("--hf-token-secret", "hf_token", metavar="NAME[:KEY]", callback=_secret,
              help=f"Secret the engines read HF_TOKEN from, at KEY [default: {HF_TOKEN_KEY}] "
              "(gated or private models).")
@pass_app
def k8s(
    app: App,
    topology_path: Path,
    out_dir: Path | None,
    namespace: str | None,
    image: str,
    ec_connector: str | None,
    gpus_per_node: int | None,
    model_pvc: str | None,
    model_host_path: str | None,
    model_mount: str | None,
    hf_cache_pvc: str | None,
    hf_token: tuple[str, str] | None,
) -> None:
    """Render Kubernetes manifests (StatefulSets, Services, proxy, ConfigMap) for TOPOLOGY

    \b
    epdctl render k8s topologies/qwen2_5-vl-1e1pd.yaml | kubectl apply -f -
    epdctl render k8s topology.yaml -o manifests/ --namespace epd
    epdctl render k8s topology.yaml --model-pvc qwen-weights   # model: /models/qwen2.5-vl-3b

    `model:` is read as the pods see it: an absolute path is a path inside the pods (it need
    not exist here), a Hugging Face id is downloaded into the pods' cache.
    """
    from epdctl.render import K8sOptions, dump_all, render_k8s, write_dir
    from epdctl.topology.model import load_topology

    # A model path is the pods', not this machine's: kept as written, need not exist here.
    topology = load_topology(topology_path, is_here=False)
    if ec_connector is None and topology.cache.connector in NETWORK_CONNECTORS:
        ec_connector = topology.cache.connector  # the topology's, where it crosses nodes
    if ec_connector is None:
        is_split = "prefill" in topology.roles
        ec_connector = EC_CONNECTOR_E_P_D if is_split else EC_CONNECTOR_E_PD
    text = topology_path.read_text(encoding="utf-8")
    secret, key = hf_token or (None, HF_TOKEN_KEY)
    options = K8sOptions(namespace=namespace, image=image, ec_connector=ec_connector,
                         gpus_per_node=gpus_per_node, model_pvc=model_pvc,
                         model_host_path=model_host_path, model_mount=model_mount,
                         hf_cache_pvc=hf_cache_pvc, hf_token_secret=secret, hf_token_key=key)
    rendering = render_k8s(topology, text, options)
    if out_dir is None:
        click.echo(dump_all(rendering, topology_path.name), nl=False)
    else:
        written = write_dir(rendering, topology_path.name, out_dir)
        app.err.print(Text(f"wrote {len(written)} files to {out_dir}"))
    for note in rendering.notes:
        app.err.print(Text("note: ", style="yellow") + Text(note))
