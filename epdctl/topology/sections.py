"""The topology file's sections (engine, cache, kv, proxy, restart, ports, roles) and the
value types they share: sizes, durations, ports, GPU lists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from epdctl import cache
from epdctl.proxy.config import defaults as _proxy_defaults
from epdctl.topology.ec_names import check_name as check_connector
from epdctl.topology.yamlfile import show

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
    log_requests: Bool = False
    """vLLM logs each request's id as it arrives (`--enable-log-requests`), so that
    `epdctl logs --request ID` finds the request's E, P and D lines; two lines per
    sub-request, so off by default. Its cost, measured on cpu-demo (2-core VM shared with
    other work, 2026-12-01; `epdctl bench` against a copy with it off, concurrency 4, 48
    requests per arm in two rounds): off / on req/s 1.16x [0.95, 1.41], TPOT 1.18x [0.96,
    1.46]: no significant difference at that size."""


class Cache(BaseModel):
    """The EC transfer between E and its consumers: epdctl's shared-memory store by default."""

    model_config = _CONFIG

    connector: Annotated[str, AfterValidator(check_connector)] = cache.CONNECTOR_NAME
    """The EC connector of every instance: epdctl's store (`EpdctlShmECConnector`), vLLM's
    `ECExampleConnector` (files under dir), `ECMooncakeConnector` (E|PD on CUDA) or
    `ECCPUConnector` (CUDA), or `module.path:ClassName` for one of your own."""
    extra_config: dict[str, Any] = {}
    """Given to every instance as `ec_connector_extra_config`, over what epdctl plans."""
    dir: Path = Field(default_factory=lambda: Path(cache.default_store_root()))
    """Store root, one sub-directory per namespace; should be on tmpfs; default
    `/dev/shm/epdctl-<uid>` (if someone else made that one first, `up` uses a fresh private
    root of its own and says so). It must be a directory of yours that nobody else can
    reach (epdctl creates it with mode 0700). A relative path is relative to the topology
    file."""
    capacity: Bytes = 8 << 30
    """Byte budget of the namespace (`8GiB`, `512MiB`, or bytes): its entries and the spare
    files E keeps pre-faulted for its next saves (the pool) stay within it."""
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
    """Bearer token clients must send on every route but /health (the instances behind the
    proxy always require a key of their own, made for each run). `${VAR}` reads it from the
    environment of `epdctl up`; a literal key in a file others can read is a `doctor`
    warning: prefer `api_key_file` or `${VAR}`."""
    api_key_file: Path | None = None
    """A file holding the api_key (its first line), owned by you and readable by you alone
    (mode 0600); relative to the topology file. Instead of `api_key`."""
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
    skip_cached_items: Bool = _PROXY["skip_cached_items"]
    """Send no item to an encoder whose embeddings are already in the EC store (E's metadata
    for the rewrite is kept beside the entry)."""
    overlap: Bool = _PROXY["overlap"]
    """Send PD (or P) its request while E encodes, not after: PD parses and preprocesses
    meanwhile, then waits for the entries E is computing (a pending mark per item in the
    store, cleared when E answers; past `encode_timeout` PD encodes the item itself). Items
    that would be rewritten to E's metadata (`metadata_rewrite`) still wait for E. Off by
    default: on a CPU-only machine E and PD then compete for the same cores, and it measured
    no faster there (`benchmarks/overlap.py`); try it with `epdctl bench --arm` where E has
    a GPU of its own."""
    encode_timeout: Seconds = _PROXY["encode_timeout_s"]
    """Deadline for an encoder's answer to one media item. With `overlap` it must be below
    `decode_timeout` (`prefill_timeout` in E|P|D): PD (or P) waits for E that long, then
    encodes the item itself, and must still answer in time."""
    prefill_timeout: Seconds = _PROXY["prefill_timeout_s"]
    """Deadline for the prefill answer (E|P|D)."""
    decode_timeout: Seconds = _PROXY["decode_timeout_s"]
    """Deadline for the first byte from decode (or PD); later chunks use the idle timeout."""
    stream_idle_timeout: Seconds = _PROXY["stream_idle_timeout_s"]
    """Longest silence allowed between two chunks of a streamed answer."""
    replay_wait: Seconds = _PROXY["replay_wait_s"]
    """How long a request whose PD, P or D instance died waits for one of that role to be
    ready again (the restarted one) when no other is healthy; it is then replayed, or a
    broken stream resumed, there. Keep it under your clients' timeouts."""
    max_inflight: Annotated[Int, Field(ge=1)] = _PROXY["max_inflight"]
    """Requests served at once; more get 503 with Retry-After."""

    @model_validator(mode="after")
    def _one_key(self) -> Proxy:
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        return self

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
    """`no`: an exit stops the topology; `on-failure`: restart the instance (an exit with
    code 0 still stops the topology)."""
    max_restarts: Annotated[Int, Field(ge=0)] = 3
    """Restarts per instance within `window`. An instance that needs one more stays down
    (`failed` in `epdctl status`, the proxy routes around it) while its role has another
    instance up; the topology stops once a role has none left."""
    window: Seconds = 600.0
    """How far back restarts count (`10m`, `90s`, or seconds): older ones are forgiven, so
    an instance that was ready for a whole window starts again with a clean count."""
    backoff: Seconds = 2.0
    """First delay; doubled for each restart of the same instance within `window`."""
    max_backoff: Seconds = 60.0
    """Longest delay (`60s`, `5m`, or seconds): the doubling stops here."""

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false.
        return "no" if value is False else value


def _check_slo(value: str) -> str:
    for pair in value.split(","):
        metric, sep, ms = pair.partition("=")
        if not sep or metric.strip() not in ("ttft", "tpot") or not re.fullmatch(
                r"\s*\d+(\.\d+)?\s*(ms)?\s*", ms):
            raise ValueError(f"expected ttft=MS,tpot=MS, got {show(value)}")
    return value


class Rebalance(BaseModel):
    """How `up --rebalance` moves GPUs between roles as the traffic shifts (docs/live.md):
    every `every`, the requests of the last `window` are run through tune's model on each
    split a switch reaches; a move is made where it pays back within `interval`."""

    model_config = _CONFIG

    enabled: Bool = False
    """Rebalance without `up --rebalance`."""
    profiles: Path | None = None
    """The `--out` of a `tune` run of this model on this machine (its profiles.json)."""
    slo: Annotated[str, AfterValidator(_check_slo)] | None = None
    """The SLO the split is chosen for: `ttft=MS,tpot=MS`."""
    every: Seconds = 30.0
    """How often it looks."""
    window: Seconds = 120.0
    """How far back the traffic it judges goes."""
    interval: Seconds = 600.0
    """How long a move must pay for itself in (its switches included)."""
    min_gap: Seconds = 300.0
    """The least time between two moves (with `margin`, what keeps it from flapping)."""
    margin: Annotated[float, Field(ge=0)] = 0.05
    """How much more a move must be predicted to serve within the SLO than staying."""
    switch_seconds: Seconds | None = None
    """What one switch costs (default: the longest start of the running instances)."""
    model_facts: Path | None = None
    """The model's facts, as given to `tune --model-facts` (default: from its config)."""


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
