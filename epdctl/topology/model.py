"""The topology file: pydantic models for what the user writes, and load_topology()."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from epdctl.errors import PlanError
from epdctl.launch.connectors import connector_for
from epdctl.proxy.config import Mode
from epdctl.topology.sections import (
    _CONFIG,
    KV,
    Cache,
    Engine,
    Ports,
    Proxy,
    Rebalance,
    Restart,
    Role,
    parse_duration,
    parse_size,
)
from epdctl.topology.yamlfile import Problems, format_errors, invalid, read_yaml, show

__all__ = [
    "NAMESPACE_FLAGS", "RESERVED_FLAGS", "ROLE_NAMES", "ROLE_PREFIX", "Role", "RoleName",
    "Topology", "canonical_flag", "flag_value", "is_local_model", "load_topology",
    "parse_duration", "parse_size", "parse_topology", "require_local_model",
]

RoleName = Literal["encode", "prefill_decode", "prefill", "decode"]
ROLE_NAMES: tuple[RoleName, ...] = ("encode", "prefill_decode", "prefill", "decode")
# Short instance-name prefixes: encode-0, pd-0, prefill-0, decode-0.
ROLE_PREFIX: dict[str, str] = {
    "encode": "encode",
    "prefill_decode": "pd",
    "prefill": "prefill",
    "decode": "decode",
}
# Engine flags that change encoder outputs for the same mm_hash: E and its consumers must
# agree on them, and they go into the EC namespace so a foreign entry is never a hit.
NAMESPACE_FLAGS = (
    "--dtype",
    "--revision",
    "--mm-processor-kwargs",
    "--media-io-kwargs",
    "--mm-hasher-algorithm",
    "--tokenizer",
)
# Flags epdctl sets itself, and where the topology says the same thing instead.
RESERVED_FLAGS = {
    "--model": "is the topology's `model`",
    "--host": "is set by epdctl (instances listen on 127.0.0.1)",
    "--port": "is set by epdctl (see `ports.base`)",
    "--served-model-name": "is set by epdctl; use `served_model_name`",
    "--tensor-parallel-size": "is set by epdctl; use the role's `tensor_parallel`",
    "-tp": "is set by epdctl; use the role's `tensor_parallel`",
    "--gpu-memory-utilization": "is set by epdctl; use the role's `gpu_memory_utilization`",
    "--ec-transfer-config": "is set by epdctl (see `cache`)",
    "--kv-transfer-config": "is set by epdctl (see `kv`)",
}
_NAME_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?")



def _flag_name(arg: str) -> str:
    name = arg.partition("=")[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of `--flag V` or `--flag=V` in args (`--flag_name` spelled too)."""
    value = None
    for i, arg in enumerate(args):
        if _flag_name(arg) != flag:
            continue
        if "=" in arg:
            value = arg.partition("=")[2]
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def canonical_flag(args: Sequence[str], flag: str) -> str | None:
    """flag_value with JSON values normalised, so `{"a": 1}` and `{"a":1}` compare equal."""
    value = flag_value(args, flag)
    if value is not None and value.lstrip().startswith(("{", "[")):
        try:
            return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
    return value


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _gpu_problems(name: str, role: Role) -> list[str]:
    need = role.replicas * role.tensor_parallel
    shape = (
        f"{_plural(role.replicas, 'replica')} x tensor_parallel {role.tensor_parallel} "
        f"{'needs' if role.replicas == 1 else 'need'} {_plural(need, 'GPU')}"
    )
    if isinstance(role.gpus, list):
        seen = set()
        for gpu in role.gpus:
            if gpu in seen:
                return [f"roles -> {name} -> gpus: GPU {gpu} is listed twice"]
            seen.add(gpu)
        if len(role.gpus) != need:
            return [f"roles -> {name} -> gpus: {shape}, {len(role.gpus)} given"]
    elif role.gpus is not None and role.gpus != need:
        return [f"roles -> {name} -> gpus: {shape}, {role.gpus} asked for"]
    return []


def _args_problems(where: str, args: Sequence[str]) -> list[str]:
    flags = dict.fromkeys(_flag_name(a) for a in args if _flag_name(a) in RESERVED_FLAGS)
    return [f"{where} -> args: {flag} {RESERVED_FLAGS[flag]}" for flag in flags]


class Topology(BaseModel):
    """A whole EPD topology on one machine."""

    model_config = _CONFIG

    name: str
    """Lower-case letters, digits and dashes (at most 42); names the state dir and labels."""
    model: Annotated[str, Field(min_length=1)]
    """Hugging Face id, or a local path starting with `/`, `./`, `../` or `~` (relative
    paths are relative to the topology file; `up` and `verify` need it to exist)."""
    served_model_name: Annotated[str, Field(min_length=1)] | None = None
    """The name clients put in `model`; default: `model` as written."""
    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda`: NVIDIA GPUs found through NVML; `cpu`: vLLM's CPU build, no GPUs."""
    engine: Engine = Engine()
    """How every instance starts: command, arguments and environment they all get."""
    cache: Cache = Cache()
    """The encoder cache between E and its consumers: the connector, and epdctl's store."""
    kv: KV = KV()
    """KV transfer from prefill to decode (E|P|D and P|D only)."""
    proxy: Proxy = Proxy()
    """The OpenAI-compatible front door."""
    ports: Ports = Ports()
    """Where instance and NIXL side-channel port numbers start."""
    restart: Restart = Restart()
    """What happens when an instance exits while serving."""
    rebalance: Rebalance = Rebalance()
    """Moving GPUs between roles as the traffic shifts (`up --rebalance`)."""
    roles: dict[RoleName, Role]
    """`encode` + `prefill_decode` (E|PD), `encode` + `prefill` + `decode` (E|P|D), or the
    same without `encode` (a baseline with no encoder disaggregation)."""

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `cache:` or `prefill_decode:` with nothing under it means "all defaults".
        if not isinstance(data, dict):
            return data
        data = {k: ({} if v is None and k in _SECTIONS else v) for k, v in data.items()}
        if isinstance(data.get("roles"), dict):
            data["roles"] = {k: {} if v is None else v for k, v in data["roles"].items()}
        return data

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME_PATTERN.fullmatch(value):
            raise ValueError(
                "expected lower-case letters, digits and dashes (at most 42, starting and "
                f"ending with a letter or digit), got {show(value)}"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> Topology:
        lines = self._role_mix()
        lines += _args_problems("engine", self.engine.args)
        encoder = self.roles.get("encode")
        lines += connector_for(self.cache.connector).problems(
            self.cache.extra_config, self.device, list(self.roles),
            None if encoder is None else encoder.tensor_parallel)
        lines += self._overlap_problems()
        for name, role in self.roles.items():
            where = f"roles -> {name}"
            if self.device == "cpu":
                if role.gpus is not None:
                    lines.append(f"{where} -> gpus: a `device: cpu` topology takes no GPUs")
                if role.tensor_parallel != 1:
                    lines.append(f"{where} -> tensor_parallel: must be 1 on `device: cpu`")
            else:
                lines += _gpu_problems(name, role)
            lines += _args_problems(where, role.args)
            if name != "encode" and "encode" in self.roles:
                encode = [*self.engine.args, *self.roles["encode"].args]
                mine = [*self.engine.args, *role.args]
                for flag in NAMESPACE_FLAGS:
                    if canonical_flag(encode, flag) != canonical_flag(mine, flag):
                        lines.append(
                            f"{where} -> args: {flag} differs from the encode role's (encoder "
                            "outputs would not fit); put it in engine.args instead"
                        )
        if lines:
            raise Problems(lines)
        return self

    def _overlap_problems(self) -> list[str]:
        """With overlap, P or PD waits for E up to encode_timeout, then encodes the item
        itself: its own timeout must leave room for that (else a hung E is a 504)."""
        proxy = self.proxy
        if not proxy.overlap or "encode" not in self.roles:
            return []
        name = "prefill_timeout" if "prefill" in self.roles else "decode_timeout"
        limit = getattr(proxy, name)
        if proxy.encode_timeout < limit:
            return []
        return [f"proxy -> encode_timeout: {proxy.encode_timeout:g}s must be below "
                f"proxy.{name} ({limit:g}s) with overlap on: P or PD waits for E that long "
                "before it encodes the item itself"]

    def _role_mix(self) -> list[str]:
        roles = set(self.roles)
        if not roles:
            return ["roles: at least one role is needed: prefill_decode, or prefill and decode"]
        if "prefill_decode" in roles and roles & {"prefill", "decode"}:
            return [
                "roles: prefill_decode cannot be combined with prefill or decode; use "
                "encode + prefill_decode (E|PD) or encode + prefill + decode (E|P|D)"
            ]
        if "prefill" in roles and "decode" not in roles:
            return ["roles: prefill needs a decode role (E|P|D)"]
        if "decode" in roles and "prefill" not in roles:
            return ["roles: decode needs a prefill role (E|P|D)"]
        if roles == {"encode"}:
            return ["roles: encode alone serves nothing; add prefill_decode, or prefill and decode"]
        return []

    @property
    def mode(self) -> Mode:
        """Which orchestration the proxy runs (its labels: MODE_LABEL): E|P|D, E|PD, P|D, or
        one aggregated PD."""
        has_e = "encode" in self.roles
        if "prefill" in self.roles:
            return "epd" if has_e else "p-d"
        return "e-pd" if has_e else "pd"

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        return self.served_model_name or self.model


_SECTIONS: dict[str, type[BaseModel]] = {
    "engine": Engine, "cache": Cache, "kv": KV, "proxy": Proxy, "ports": Ports,
    "restart": Restart, "rebalance": Rebalance,
}


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed in the mapping at loc (for "did you mean")."""
    if not loc:
        return list(Topology.model_fields)
    if len(loc) == 1 and loc[0] in _SECTIONS:
        return list(_SECTIONS[str(loc[0])].model_fields)
    if len(loc) == 2 and loc[0] == "roles":
        return list(Role.model_fields)
    return []


def parse_topology(data: Any, source: str = "topology") -> Topology:
    """Validate already-parsed YAML; raise TopologyError with one line per problem."""
    if data is None:
        raise invalid(source, ["the file is empty"])
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value ({show(data)})"
        raise invalid(source, [f"expected a mapping (name:, model:, roles:, ...), got {kind}"])
    try:
        return Topology.model_validate(data)
    except ValidationError as exc:
        lines = format_errors(exc, data, _fields_at, {"roles": ROLE_NAMES})
        raise invalid(source, lines) from None


def is_local_model(model: str) -> bool:
    """Whether `model` names a path (`/`, `./`, `../`, `~`) rather than a Hugging Face id."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def require_local_model(topology: Topology) -> None:
    """Raise PlanError when the model is a local path missing here (`up`, `verify`)."""
    # Not part of loading: render and --dry-run work without the model on this machine.
    if not is_local_model(topology.model) or Path(topology.model).expanduser().exists():
        return
    from epdctl.dev.tiny_models import KINDS, default_cache_root

    path, root = Path(topology.model).expanduser(), default_cache_root()
    if path.name in KINDS and (path.parent == root or path.parent.name == "tiny-models"):
        link = "" if path.parent == root else f" --link {path}"
        fix = f"build it with `python -m epdctl.dev.tiny_models {path.name}{link}`"
    else:
        fix = "put the model there, or name a Hugging Face id"
    raise PlanError(f"`{topology.name}`: model path {path} does not exist; {fix}")


def _with_paths_resolved(data: Any, base: Path) -> Any:
    """The parsed YAML with local model, cache and key file paths made absolute, relative to
    the topology file: done before validation, so a validated Topology is never patched.
    A value of the wrong type is left as it is, for validation to name."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    model = data.get("model")
    if isinstance(model, str) and is_local_model(model):
        data["model"] = str((base / Path(model).expanduser()).resolve())
    cache = data.get("cache")
    if isinstance(cache, dict) and isinstance(cache.get("dir"), str):
        data["cache"] = {**cache, "dir": str((base / Path(cache["dir"]).expanduser()).absolute())}
    rebalance = data.get("rebalance")
    if isinstance(rebalance, dict):
        data["rebalance"] = {k: str((base / Path(v).expanduser()).absolute())
                             if k in ("profiles", "model_facts") and isinstance(v, str) else v
                             for k, v in rebalance.items()}
    proxy = data.get("proxy")
    if isinstance(proxy, dict) and isinstance(proxy.get("api_key_file"), str):
        key_file = Path(proxy["api_key_file"]).expanduser()
        if not key_file.is_absolute():
            data["proxy"] = {**proxy, "api_key_file": str((base / key_file).absolute())}
    return data


def load_topology(path: str | Path, *, is_here: bool = True) -> Topology:
    """Read and validate a topology YAML file; relative model and cache paths become absolute
    (unless `is_here` is False: paths as written, for machines elsewhere, e.g. the pods).

    A local model path need not exist (render and --dry-run work without it); what needs
    the model calls `require_local_model`.
    """
    path = Path(path)
    data = read_yaml(path)
    return parse_topology(_with_paths_resolved(data, path.parent) if is_here else data, str(path))
