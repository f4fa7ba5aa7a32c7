"""The topology file: pydantic models for what the user writes, and load_topology()."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from epdctl._topology_file import Problems, format_errors, invalid, read_yaml, show
from epdctl.proxy.config import defaults as _proxy_defaults

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

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: Any) -> int:
    """`8GiB`, `512M`, `1000` (bytes) -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, bool | float) or not match or match[2].lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 8GiB or 512MiB, got {show(value)}")
    return int(float(match[1]) * _SIZE_UNITS[match[2].lower()])


def parse_duration(value: Any) -> float:
    """`30m`, `90s`, `1.5h`, `45` (seconds) -> seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, bool) or not match or match[2].lower() not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as 30s, 10m or 2h, got {show(value)}")
    return float(match[1]) * _DURATION_UNITS[match[2].lower()]


def _check_port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"expected a port number from 1 to 65535, got {value}")
    return value


def _check_gpus(value: Any) -> Any:
    # One clean message instead of pydantic's two union branches (list[...] / int).
    for item in value if isinstance(value, list) else [] if value is None else [value]:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(f"expected a list of GPU indices or a count, got {show(item)}")
    return value


def _check_fraction(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"expected a fraction of GPU memory above 0 and at most 1, got {value}")
    return value


Int = Annotated[int, Field(strict=True)]
Bytes = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
Seconds = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]
Port = Annotated[int, Field(strict=True), AfterValidator(_check_port)]
Bool = Annotated[bool, Field(strict=True)]

_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
# Numbers in argv and env lists are common in YAML (`--max-model-len, 8192`); accept them.
_ARGS_CONFIG = ConfigDict(**_CONFIG, coerce_numbers_to_str=True)


class Engine(BaseModel):
    """How an engine process starts."""

    model_config = _ARGS_CONFIG

    command: Annotated[list[str], Field(min_length=1)] | None = None
    """argv prefix that starts one engine, before the model; default `vllm serve`
    (`python -m epdctl.engines.vllm_cpu serve` on `device: cpu`)."""
    args: list[str] = []
    """Arguments given to every instance, after the model (numbers are written as text)."""
    env: dict[str, str] = {}
    """Environment given to every instance."""


class Cache(BaseModel):
    """The built-in shared-memory EC store."""

    model_config = _CONFIG

    dir: Path = Path("/dev/shm/epdctl")
    """Store root, one sub-directory per namespace; should be on tmpfs. A relative path is
    relative to the topology file."""
    capacity: Bytes = 8 << 30
    """Byte budget the janitor keeps the namespace under (`8GiB`, `512MiB`, or bytes)."""
    ttl: Seconds = 1800.0
    """Entries unused for this long are evicted (`30m`, `90s`, or seconds)."""
    grace: Seconds = 120.0
    """Entries younger than this are never evicted (E answered, P/PD has not loaded yet)."""
    keep_on_down: Bool = False
    """Keep the store's files when the topology goes down."""


class KV(BaseModel):
    """KV transfer between prefill and decode (E|P|D only)."""

    model_config = _CONFIG

    connector: Annotated[str, Field(min_length=1)] | None = None
    """vLLM KV connector name; default NixlConnector (ExampleConnector on `device: cpu`)."""
    extra_config: dict[str, Any] = {}
    """`kv_connector_extra_config` given to P and D."""


_PROXY = _proxy_defaults()


class Proxy(BaseModel):
    """The embedded OpenAI-compatible proxy in front of the instances.

    Each field is a knob of `epdctl.proxy.config.ProxyConfig` (same name, less `_s`), which
    holds its default; the plan maps one into the other by name.
    """

    model_config = _CONFIG

    host: str = _PROXY["host"]
    """Address to bind (`0.0.0.0` for every interface). Anything but loopback should come
    with an api_key."""
    port: Port = _PROXY["port"]
    """Port clients connect to."""
    api_key: Annotated[str, Field(min_length=1)] | None = _PROXY["api_key"]
    """Bearer token required on every route but /health."""
    metadata_rewrite: Bool = _PROXY["metadata_rewrite"]
    """Replace media by E's `*_embeds` metadata so P/PD skip preprocessing (where supported)."""
    client_uuids: Bool = _PROXY["client_uuids"]
    """Honour a media part's client-supplied `uuid` as its cache key (default): the proxy
    rewrites it into a key space of its own, so it only ever matches the same client uuid,
    never an item keyed by its content. `false` ignores client uuids and keys every item by
    its content, which a proxy shared by several people wants: there, two clients picking
    the same uuid for different images would get each other's answers. On by default: it is
    vLLM's own meaning of `uuid`, and the only key an item without fetchable bytes (a
    `file:` URL) can have, which Mooncake requires."""
    encode_timeout: Seconds = _PROXY["encode_timeout_s"]
    """Deadline for an encoder's answer to one media item."""
    prefill_timeout: Seconds = _PROXY["prefill_timeout_s"]
    """Deadline for the prefill answer (E|P|D)."""
    decode_timeout: Seconds = _PROXY["decode_timeout_s"]
    """Deadline for the first byte from decode (or PD); later chunks use the idle timeout."""
    stream_idle_timeout: Seconds = _PROXY["stream_idle_timeout_s"]
    """Longest silence allowed between two chunks of a streamed answer."""
    max_inflight: Annotated[Int, Field(ge=1)] = _PROXY["max_inflight"]
    """Requests served at once; more get 503 with Retry-After."""

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        if not value or any(c in value for c in "/ \t") or value.count(":") == 1:
            raise ValueError(
                f"expected an address such as 127.0.0.1 or 0.0.0.0 (no scheme or port), "
                f"got {show(value)}"
            )
        return value


class Restart(BaseModel):
    """What the supervisor does when an instance exits while serving."""

    model_config = _CONFIG

    policy: Literal["no", "on-failure"] = "no"
    """`no`: an exit stops the topology; `on-failure`: restart the instance."""
    max_restarts: Annotated[Int, Field(ge=0)] = 3
    """Restarts per instance before giving up and stopping the topology."""
    backoff: Seconds = 2.0
    """First delay; doubled on each restart of the same instance."""

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false.
        return "no" if value is False else value


class Ports(BaseModel):
    """Where port planning starts."""

    model_config = _CONFIG

    base: Port = 8100
    """First HTTP port for instances, one each in role order; proxy.port is skipped."""
    side_channel_base: Port = 5600
    """First NIXL side-channel port (one per prefill/decode instance)."""


class Role(BaseModel):
    """One role: how many instances, where they run, and their extra vLLM arguments."""

    model_config = _ARGS_CONFIG

    replicas: Annotated[Int, Field(ge=1)] = 1
    """Instances of this role; named `<prefix>-0`, `<prefix>-1`, ..."""
    gpus: Annotated[list[int] | int | None, BeforeValidator(_check_gpus)] = None
    """GPU indices for all replicas (replicas x tensor_parallel of them, in order), or a
    count to pick from the GPUs no role lists; default: pick. Indices count the GPUs
    epdctl sees (after an outer CUDA_VISIBLE_DEVICES)."""
    tensor_parallel: Annotated[Int, Field(ge=1)] = 1
    """GPUs per replica (`--tensor-parallel-size`)."""
    gpu_memory_utilization: Annotated[float, Field(strict=True), AfterValidator(_check_fraction)] \
        | None = None
    """Fraction of each GPU this instance may take; required when GPUs are shared."""
    args: list[str] = []
    """vLLM arguments for this role, after engine.args (numbers are written as text)."""
    env: dict[str, str] = {}
    """Environment for this role, over engine.env."""


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
    paths are relative to the topology file; the path must exist)."""
    served_model_name: Annotated[str, Field(min_length=1)] | None = None
    """The name clients put in `model`; default: `model` as written."""
    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda`: NVIDIA GPUs found through NVML; `cpu`: vLLM's CPU build, no GPUs."""
    engine: Engine = Engine()
    """How every instance starts: command, arguments and environment they all get."""
    cache: Cache = Cache()
    """The shared-memory encoder cache between E and its consumers."""
    kv: KV = KV()
    """KV transfer from prefill to decode (E|P|D and P|D only)."""
    proxy: Proxy = Proxy()
    """The OpenAI-compatible front door."""
    ports: Ports = Ports()
    """Where instance and NIXL side-channel port numbers start."""
    restart: Restart = Restart()
    """What happens when an instance exits while serving."""
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
    def mode(self) -> Literal["epd", "e-pd", "p-d", "pd"]:
        """Which orchestration the proxy runs: E|P|D, E|PD, P|D, or one aggregated PD."""
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
    "restart": Restart,
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


def _resolve(topology: Topology, base: Path, source: str) -> Topology:
    """Make local model and cache paths absolute, relative to the topology file."""
    update: dict[str, Any] = {}
    if topology.model.startswith(("/", "./", "../", "~")) or topology.model in (".", ".."):
        model = (base / Path(topology.model).expanduser()).resolve()
        if not model.exists():
            raise invalid(source, [f"model: local path {model} does not exist"])
        update["model"] = str(model)
    cache_dir = (base / topology.cache.dir.expanduser()).absolute()
    if cache_dir != topology.cache.dir:
        update["cache"] = topology.cache.model_copy(update={"dir": cache_dir})
    return topology.model_copy(update=update) if update else topology


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file; relative model and cache paths become absolute."""
    path = Path(path)
    topology = parse_topology(read_yaml(path), str(path))
    return _resolve(topology, path.parent, str(path))
