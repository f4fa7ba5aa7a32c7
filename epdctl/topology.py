"""The topology file: pydantic models for what the user writes, and load_topology()."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from epdctl.errors import TopologyError

RoleName = Literal["encode", "prefill_decode", "prefill", "decode"]
ROLE_NAMES: tuple[RoleName, ...] = ("encode", "prefill_decode", "prefill", "decode")
# Short instance-name prefixes: encode-0, pd-0, prefill-0, decode-0.
ROLE_PREFIX: dict[str, str] = {
    "encode": "encode",
    "prefill_decode": "pd",
    "prefill": "prefill",
    "decode": "decode",
}
MAX_TOPOLOGY_BYTES = 1 << 20

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
    if isinstance(value, bool):
        raise ValueError("expected a size such as 8GiB or 512MiB")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 8GiB or 512MiB, not {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(value: Any) -> float:
    """`30m`, `90s`, `1.5h`, `45` (seconds) -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 10m or 2h")
    if isinstance(value, int | float):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as 30s, 10m or 2h, not {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


Bytes = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
Seconds = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]
Port = Annotated[int, Field(ge=1, le=65535)]

_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Engine(BaseModel):
    """How an engine process starts."""

    model_config = _CONFIG

    command: list[str] | None = None
    """argv prefix that starts one engine; default `vllm serve` (a CPU launcher on `device: cpu`)."""
    args: list[str] = []
    """Arguments given to every instance, after the model."""
    env: dict[str, str] = {}
    """Environment given to every instance."""


class Cache(BaseModel):
    """The built-in shared-memory EC store."""

    model_config = _CONFIG

    dir: Path = Path("/dev/shm/epdctl")
    """Store root; one sub-directory per namespace. Should be on tmpfs."""
    capacity: Bytes = 8 << 30
    """Byte budget the janitor keeps the namespace under."""
    ttl: Seconds = 1800.0
    """Entries unused for this long are evicted."""
    grace: Seconds = 120.0
    """Entries younger than this are never evicted (E answered, P/PD has not loaded yet)."""
    keep_on_down: bool = False
    """Keep the store's files when the topology goes down."""


class KV(BaseModel):
    """KV transfer between prefill and decode (E|P|D only)."""

    model_config = _CONFIG

    connector: str | None = None
    """vLLM KV connector name; default NixlConnector (ExampleConnector on `device: cpu`)."""
    extra_config: dict[str, Any] = {}
    """`kv_connector_extra_config` given to P and D."""


class Proxy(BaseModel):
    """The embedded OpenAI-compatible proxy in front of the instances."""

    model_config = _CONFIG

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback should come with an api_key."""
    port: Port = 8000
    api_key: str | None = None
    """Bearer token required on every route but /health."""
    metadata_rewrite: bool = True
    """Replace media by E's `*_embeds` metadata so P/PD skip preprocessing (where supported)."""
    encode_timeout: Seconds = 60.0
    prefill_timeout: Seconds = 120.0
    decode_timeout: Seconds = 120.0
    """Deadline for the first byte from decode (or PD); later chunks use the idle timeout."""
    stream_idle_timeout: Seconds = 60.0
    max_inflight: int = Field(256, ge=1)
    """Requests served at once; more get 503 with Retry-After."""


class Restart(BaseModel):
    """What the supervisor does when an instance exits while serving."""

    model_config = _CONFIG

    policy: Literal["no", "on-failure"] = "no"
    max_restarts: int = Field(3, ge=0)
    backoff: Seconds = 2.0
    """First delay; doubled on each restart of the same instance."""


class Ports(BaseModel):
    """Where port planning starts."""

    model_config = _CONFIG

    base: Port = 8100
    """First HTTP port for instances; the proxy uses proxy.port."""
    side_channel_base: Port = 5600
    """First NIXL side-channel port (one per P/D instance)."""


class Role(BaseModel):
    """One role: how many instances, where they run, and their extra vLLM arguments."""

    model_config = _CONFIG

    replicas: int = Field(1, ge=1)
    gpus: list[Annotated[int, Field(ge=0)]] | Annotated[int, Field(ge=0)] | None = None
    """GPU indices for all replicas (replicas x tensor_parallel of them), or a count to pick."""
    tensor_parallel: int = Field(1, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of each GPU this instance may take; required when GPUs are shared."""
    args: list[str] = []
    env: dict[str, str] = {}


class Topology(BaseModel):
    """A whole EPD topology on one machine."""

    model_config = _CONFIG

    name: Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")]
    """Lower-case letters, digits and dashes; names the state dir and Kubernetes labels."""
    model: Annotated[str, Field(min_length=1)]
    """Hugging Face id or local path (relative paths are relative to the topology file)."""
    served_model_name: str | None = None
    device: Literal["cuda", "cpu"] = "cuda"
    engine: Engine = Engine()
    cache: Cache = Cache()
    kv: KV = KV()
    proxy: Proxy = Proxy()
    ports: Ports = Ports()
    restart: Restart = Restart()
    roles: dict[RoleName, Role]

    @model_validator(mode="after")
    def _check_roles(self) -> Topology:
        roles = set(self.roles)
        if not roles:
            raise ValueError("roles: at least one role is needed")
        if "prefill_decode" in roles and roles & {"prefill", "decode"}:
            raise ValueError(
                "roles: prefill_decode cannot be combined with prefill/decode "
                "(use E|PD or E|P|D, not both)"
            )
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("roles: prefill and decode go together (E|P|D needs both)")
        if roles == {"encode"}:
            raise ValueError("roles: encode alone serves nothing; add prefill_decode or prefill+decode")
        if self.device == "cpu":
            for name, role in self.roles.items():
                if role.gpus is not None:
                    raise ValueError(f"roles -> {name} -> gpus: a `device: cpu` topology takes no GPUs")
                if role.tensor_parallel != 1:
                    raise ValueError(f"roles -> {name} -> tensor_parallel: must be 1 on `device: cpu`")
        for name, role in self.roles.items():
            if isinstance(role.gpus, list):
                need = role.replicas * role.tensor_parallel
                if len(role.gpus) != need:
                    raise ValueError(
                        f"roles -> {name} -> gpus: {role.replicas} replica(s) x "
                        f"tensor_parallel {role.tensor_parallel} need {need} GPU(s), "
                        f"{len(role.gpus)} given"
                    )
                if len(set(role.gpus)) != len(role.gpus):
                    raise ValueError(f"roles -> {name} -> gpus: a GPU is listed twice")
            elif isinstance(role.gpus, int) and role.gpus != role.replicas * role.tensor_parallel:
                raise ValueError(
                    f"roles -> {name} -> gpus: {role.replicas} replica(s) x tensor_parallel "
                    f"{role.tensor_parallel} need {role.replicas * role.tensor_parallel} GPU(s), "
                    f"{role.gpus} asked for"
                )
        return self

    @property
    def mode(self) -> Literal["aggregated", "epd", "e-pd", "p-d", "pd"]:
        """Which orchestration the proxy runs."""
        has_e = "encode" in self.roles
        if "prefill" in self.roles:
            return "epd" if has_e else "p-d"
        return "e-pd" if has_e else "pd"

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        return self.served_model_name or self.model


def _location(loc: tuple[int | str, ...]) -> str:
    return " -> ".join(str(part) for part in loc)


def _format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("list[", "int", "constrained-"))))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if err["type"] == "value_error" and " -> " in msg.split(":")[0]:
            # Cross-field checks name their own location.
            lines.append(msg)
        elif loc:
            lines.append(f"{_location(loc)}: {msg}")
        else:
            lines.append(msg)
    return list(dict.fromkeys(lines))


def parse_topology(data: Any, source: str = "topology") -> Topology:
    """Validate already-parsed YAML; raise TopologyError with one line per problem."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise TopologyError(f"{source}: invalid topology\n  the file is {kind}")
    try:
        return Topology.model_validate(data)
    except ValidationError as exc:
        body = "\n".join(f"  {line}" for line in _format_errors(exc))
        raise TopologyError(f"{source}: invalid topology\n{body}") from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file; relative model paths become absolute."""
    import yaml

    path = Path(path)
    try:
        if path.stat().st_size > MAX_TOPOLOGY_BYTES:
            raise TopologyError(f"{path}: too large for a topology file (over 1 MiB)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TopologyError(f"{path}: is a directory, not a topology file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path}: cannot read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise TopologyError(f"{path}: not valid YAML{where}: {problem}") from None
    topology = parse_topology(data, str(path))
    model = topology.model
    if model.startswith((".", "/", "~")):
        resolved = (path.parent / Path(model).expanduser()).resolve()
        if not resolved.exists():
            raise TopologyError(
                f"{path}: invalid topology\n  model: local path {resolved} does not exist"
            )
        topology = topology.model_copy(update={"model": str(resolved)})
    return topology
