"""Checks of what the topology asks for: the model, and settings known not to work."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from epdctl.launch.plan import Plan, flag_value
from epdctl.launch.preflight import Check, kv_connector
from epdctl.topology.model import Topology

_TRUE = ("1", "true", "yes", "on")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def hf_hub_cache(environ: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloads, by its own environment rules."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface" / "hub"


def _cached_snapshot(hub: Path, model: str, revision: str | None) -> Path | None:
    """The cached snapshot of a hub model that has its config.json, if any."""
    repo = hub / f"models--{model.replace('/', '--')}"
    if revision is not None:
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        candidates = [repo / "snapshots" / commit]
    else:
        ref = repo / "refs" / "main"
        main = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        others = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        candidates = main + others
    return next((s for s in candidates if (s / "config.json").is_file()), None)


def _tiny_model_kind(path: Path) -> str | None:
    """The tiny-model recipe a missing path belongs to, if it is one of the dev builds."""
    from epdctl.dev.tiny_models import KINDS, default_cache_root

    if path.parent != default_cache_root().expanduser().resolve():
        return None
    return next((k for k in KINDS if path.name == k or path.name.startswith(f"{k}-")), None)


def check_model(topology: Topology, environ: Mapping[str, str], python: str | None) -> Check:
    """A local model directory exists with config.json; a hub id is cached, or may download."""
    model = topology.model
    if Path(model).is_absolute():
        path = Path(model)
        if not path.exists():
            kind = _tiny_model_kind(path)
            fix = "correct `model:` in the topology, or put the model there"
            if kind is not None:
                build = f"{shlex.quote(python or 'python')} -m epdctl.dev.tiny_models {kind}"
                fix = f"build it: `{build}`"
            return Check("model", "fail", f"local path {path} does not exist", fix)
        if not (path / "config.json").is_file():
            return Check("model", "fail", f"{path} has no config.json, so it is not a "
                         "Hugging Face model directory", "point `model:` at the directory "
                         "that holds config.json")
        return Check("model", "ok", f"local model {path}")
    revision = flag_value(topology.engine.args, "--revision")
    hub = hf_hub_cache(environ)
    snapshot = _cached_snapshot(hub, model, revision)
    shown = model if revision is None else f"{model} (revision {revision})"
    if snapshot is not None:
        return Check("model", "ok", f"{shown} is in the Hugging Face cache ({snapshot})")
    download = f"`hf download {model}`" + (f" --revision {revision}" if revision else "")
    if environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return Check("model", "fail", f"{shown} is not in the Hugging Face cache ({hub}) and "
                     "HF_HUB_OFFLINE is set", f"download it first ({download} with the "
                     "network on), or point `model:` at a local copy")
    return Check("model", "warn", f"{shown} is not in the Hugging Face cache ({hub}): the "
                 "first `up` downloads it", f"download it ahead: {download} (a gated model "
                 "needs HF_TOKEN)")


def check_combinations(topology: Topology, plan: Plan | None) -> list[Check]:
    """Settings that validate but are known not to work (or not to do what they say)."""
    name = "combination"
    found: list[Check] = []
    connector = kv_connector(topology)
    if topology.kv.connector and connector is None:
        found.append(Check(name, "warn", f"kv.connector {topology.kv.connector} is ignored: "
                           f"the roles ({', '.join(topology.roles)}) have no prefill/decode "
                           "split", "remove `kv:`, or use prefill + decode roles"))
    if connector == "MooncakeConnector":
        # Its decode side needs transfer_id, remote_bootstrap_addr and remote_engine_id
        # from the router (vllm-epd-contracts.md §6.1); the proxy forwards P's params only.
        found.append(Check(name, "fail", "kv.connector MooncakeConnector needs a router that "
                           "sends decode a transfer_id and Mooncake bootstrap address; "
                           "epdctl's proxy passes on prefill's kv_transfer_params only",
                           "use NixlConnector (the default on `device: cuda`)"))
    if connector in ("NixlConnector", "NixlPullConnector", "NixlPushConnector") \
            and topology.device == "cuda" and "qwen3.5" in topology.model.lower().replace("_", "."):
        missing = [s.name for s in plan.instances if s.role in ("prefill", "decode")
                   and s.env.get("VLLM_SSM_CONV_STATE_LAYOUT") != "DS"] if plan else []
        if missing:
            found.append(Check(name, "warn", f"Qwen3.5 over NIXL needs "
                               f"VLLM_SSM_CONV_STATE_LAYOUT=DS on P and D; "
                               f"{', '.join(missing)} lack it",
                               "add it to engine.env"))
    if topology.proxy.host not in _LOOPBACK and topology.proxy.api_key is None:
        found.append(Check(name, "warn", f"the proxy listens on {topology.proxy.host} with no "
                           "api_key: anyone who reaches the port can use the model",
                           "set proxy.api_key, or proxy.host: 127.0.0.1"))
    return found or [Check(name, "ok", "no known-bad combination")]
