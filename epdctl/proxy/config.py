"""ProxyConfig: the one list of the proxy's knobs. Its argv, and the argparse that reads that
argv back, are derived from the fields below; each default is written here once.

Adding a knob: a field here (with `knob(...)`), and, when topologies may set it, a field of
the same name (without `_s`) in `topology.Proxy`. Nothing else: the plan maps one into the
other by name, `to_argv()` writes it and `argv.parse_argv()` reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

Mode = Literal["epd", "e-pd", "p-d", "pd"]
"""How a topology is orchestrated (state.json, `status`), one spelling; MODE_LABEL for people."""
MODE_LABEL: dict[str, str] = {"epd": "E|P|D", "e-pd": "E|PD", "p-d": "P|D", "pd": "PD"}

# The API key travels in the environment, never on a command line (`ps` shows those).
API_KEY_ENV = "EPDCTL_PROXY_API_KEY"
# The key the instances require (their VLLM_API_KEY): only the proxy, not its clients, has it.
UPSTREAM_KEY_ENV = "EPDCTL_PROXY_UPSTREAM_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def knob(default: Any, flag: str | None, help: str, *, metavar: str | None = None,
         choices: Sequence[str] | None = None, is_shown: bool = False) -> Any:
    """A ProxyConfig field with its command-line flag; is_shown: always written to argv (so
    the proxy's first log line states it), not only when it differs from the default."""
    meta = {"flag": flag, "help": help, "metavar": metavar, "choices": choices,
            "is_shown": is_shown}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Where the proxy listens, where the instances are, and how long each stage may take."""

    host: str = knob("127.0.0.1", "--host",
                     "address to bind; anything but loopback should come with an API key",
                     is_shown=True)
    port: int = knob(8000, "--port", "port to bind", is_shown=True)
    models: tuple[str, ...] = knob((), "--model",
                                   "model name the instances serve (repeat for several); "
                                   "a request naming another model gets a 404")
    encode: tuple[str, ...] = knob((), "--encode", "base URL of an encoder (ec_producer) "
                                   "instance; repeat for replicas", metavar="URL")
    prefill_decode: tuple[str, ...] = knob((), "--prefill-decode", "base URL of a "
                                           "prefill+decode instance; repeat for replicas",
                                           metavar="URL")
    prefill: tuple[str, ...] = knob((), "--prefill", "base URL of a prefill (kv_producer) "
                                    "instance; repeat for replicas", metavar="URL")
    decode: tuple[str, ...] = knob((), "--decode", "base URL of a decode (kv_consumer) "
                                   "instance; repeat for replicas", metavar="URL")
    encode_timeout_s: float = knob(60.0, "--encode-timeout", "seconds an encoder gets per item "
                                   "before PD encodes it itself", is_shown=True)
    prefill_timeout_s: float = knob(120.0, "--prefill-timeout",
                                    "seconds the prefill stage gets (E|P|D)", is_shown=True)
    decode_timeout_s: float = knob(120.0, "--decode-timeout", "seconds until the first byte "
                                   "from decode or PD; later chunks use the idle timeout",
                                   is_shown=True)
    stream_idle_timeout_s: float = knob(60.0, "--stream-idle-timeout", "seconds allowed "
                                        "between two chunks of a stream", is_shown=True)
    replay_wait_s: float = knob(60.0, "--replay-wait", "seconds a request whose final stage "
                                "(or prefill) died waits for an instance of that role to be "
                                "ready again, when no other is healthy, before it fails")
    max_inflight: int = knob(256, "--max-inflight", "requests served at once; more get 503 "
                             "with Retry-After", is_shown=True)
    metadata_rewrite: bool = knob(True, "--metadata-rewrite", "send PD E's *_embeds metadata "
                                  "instead of the media where the model supports it")
    client_uuids: bool = knob(True, "--client-uuids", "key media by a client's `uuid` where "
                              "given (in a key space of its own, so it never aliases a "
                              "content key); --no-client-uuids ignores them and keys every "
                              "item by its content, for proxies shared by several people")
    skip_cached_items: bool = knob(True, "--skip-cached-items", "send an item to no encoder "
                                   "when its entry is already in the EC store (--store-dir)")
    overlap: bool = knob(False, "--overlap", "send PD (or P) its request while E encodes, "
                         "not after: PD prepares it meanwhile and waits for the entries E is "
                         "computing (with --store-dir; items rewritten to metadata still wait "
                         "for E)")
    store_dir: str = knob("", "--store-dir", "root of the topology's shared-memory EC store, "
                          "looked in before the E stage (with --namespace); empty: never "
                          "skips", metavar="DIR")
    namespace: str = knob("", "--namespace", "the topology's EC namespace in --store-dir",
                          metavar="NS")
    connect_timeout_s: float = knob(5.0, "--connect-timeout",
                                    "seconds to connect to an instance")
    retry_after_s: int = knob(1, "--retry-after", "Retry-After seconds on a 503")
    api_key: str | None = knob(None, None, f"bearer token every route but /health requires "
                               f"(${API_KEY_ENV}; never on the command line)")
    upstream_api_key: str | None = knob(None, None, f"bearer token the proxy sends the "
                                        f"instances (${UPSTREAM_KEY_ENV}; never on the "
                                        "command line)")
    max_body_bytes: int = knob(64 * 1024 * 1024, "--max-body-bytes",
                               "larger request bodies get 413")
    media_fetch_timeout_s: float = knob(10.0, "--media-fetch-timeout", "seconds to fetch an "
                                        "http(s) media URL (hashed for the cache key)")
    health_interval_s: float = knob(2.0, "--health-interval",
                                    "seconds between health probes of every instance")
    health_timeout_s: float = knob(1.0, "--health-timeout", "seconds one health probe may take")
    eject_after: int = knob(3, "--eject-after", "failed probes in a row before an instance "
                            "gets no requests")
    ec_protocol: Literal["shared", "mooncake"] = knob(
        "shared", "--ec-protocol", "how E hands encodings to PD: a shared store keyed by "
        "content, or mooncake: pick PD first and have E push into it (vLLM's "
        "ECMooncakeConnector, E|PD only)", choices=("shared", "mooncake"))
    ec_consumers: tuple[tuple[str, str], ...] = knob(
        (), "--ec-consumer", "a --prefill-decode URL and its Mooncake control socket, e.g. "
        "http://pd-0:8000=tcp://pd-0:14579; one per --prefill-decode", metavar="URL=ZMQ")
    client: Literal["aiohttp", "httpx"] = knob(
        "aiohttp", "--client", "upstream HTTP client (see benchmarks/proxy.py)",
        choices=("aiohttp", "httpx"))

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model name is needed")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together")
        if self.prefill_decode and self.prefill:
            raise ValueError("--prefill-decode cannot be combined with --prefill/--decode")
        if not self.prefill_decode and not self.prefill:
            raise ValueError("give --prefill-decode, or --prefill and --decode")
        for flag, urls in (("--encode", self.encode), ("--prefill-decode", self.prefill_decode),
                           ("--prefill", self.prefill), ("--decode", self.decode)):
            for url in urls:
                _check_instance_url(flag, url)
        if self.ec_protocol not in ("shared", "mooncake"):
            raise ValueError(f"unknown EC protocol `{self.ec_protocol}`")
        if bool(self.store_dir) != bool(self.namespace):
            raise ValueError("--store-dir and --namespace go together")
        if self.overlap and self.encode and self.encode_timeout_s >= self.beside_e_timeout_s:
            flag = "--prefill-timeout" if self.is_split else "--decode-timeout"
            raise ValueError(
                f"--encode-timeout ({self.encode_timeout_s:g}s) must be below {flag} "
                f"({self.beside_e_timeout_s:g}s) with --overlap: P or PD waits for E that "
                "long before it encodes the item itself")
        if self.ec_protocol == "mooncake":
            self._check_mooncake()
        elif self.ec_consumers:
            raise ValueError("--ec-consumer needs --ec-protocol mooncake")

    def _check_mooncake(self) -> None:
        # vLLM's Mooncake consumer routing covers E+PD only (its example proxy refuses P|D).
        if self.is_split:
            raise ValueError("--ec-protocol mooncake supports --prefill-decode only, not "
                             "--prefill/--decode")
        known = {url.rstrip("/") for url in self.prefill_decode}
        given = [url.rstrip("/") for url, _ in self.ec_consumers]
        for url in given:
            if url not in known:
                raise ValueError(f"--ec-consumer {url}: not one of the --prefill-decode URLs")
        missing = sorted(known - set(given))
        if missing:
            raise ValueError(f"--ec-protocol mooncake: --prefill-decode {missing[0]} needs an "
                             "--ec-consumer")
        for url, address in self.ec_consumers:
            if not address.startswith("tcp://"):
                raise ValueError(f"--ec-consumer {url}: `{address}` is not tcp://host:port")

    def consumer_zmq(self, url: str) -> str:
        """The Mooncake control socket of the PD instance at `url`."""
        for known, address in self.ec_consumers:
            if known.rstrip("/") == url:
                return address
        raise KeyError(url)

    @property
    def should_look_up(self) -> bool:
        """Whether items are looked up in the store before the E stage."""
        return self.skip_cached_items and self.has_store

    @property
    def should_overlap(self) -> bool:
        """Whether PD gets its request while E still encodes (pending marks in the store)."""
        return self.overlap and self.has_store

    @property
    def has_store(self) -> bool:
        """Whether the proxy knows the topology's EC store (epdctl's own, on this host)."""
        return bool(self.store_dir) and bool(self.encode) and self.ec_protocol == "shared"

    @property
    def is_split(self) -> bool:
        """True for P|D (prefill then decode), False for one PD stage."""
        return bool(self.prefill)

    @property
    def final_role(self) -> str:
        """The role whose instances give the client its answer, decode or prefill_decode:
        the name of its pool, and of its stage in errors and metrics."""
        return "decode" if self.is_split else "prefill_decode"

    @property
    def beside_e_timeout_s(self) -> float:
        """The timeout of the stage that gets its request beside E's with overlap (prefill
        in E|P|D, else PD): it includes a wait for E of up to encode_timeout_s."""
        return self.prefill_timeout_s if self.is_split else self.decode_timeout_s

    @property
    def final_read_s(self) -> float:
        """How long the final stage may go without sending anything (it may stream)."""
        return max(self.decode_timeout_s, self.stream_idle_timeout_s)

    @property
    def mode(self) -> Mode:
        if self.is_split:
            return "epd" if self.encode else "p-d"
        return "e-pd" if self.encode else "pd"

    def to_argv(self, *, exclude: Sequence[str] = ()) -> list[str]:
        """The flags that make `parse_argv` return this config (the API key stays out)."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            flag = f.metadata["flag"]
            value = getattr(self, f.name)
            if flag is None or f.name in exclude:
                continue
            if value == f.default and not f.metadata["is_shown"]:
                continue
            if isinstance(value, bool):
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif isinstance(value, tuple):
                for item in value:
                    argv += [flag, "=".join(item) if isinstance(item, tuple) else item]
            else:
                argv += [flag, str(value)]
        return argv

    def env(self) -> dict[str, str]:
        """What the proxy process needs in its environment (the API keys)."""
        env = {API_KEY_ENV: self.api_key} if self.api_key else {}
        if self.upstream_api_key:
            env[UPSTREAM_KEY_ENV] = self.upstream_api_key
        return env


def _check_instance_url(flag: str, url: str) -> None:
    """An instance's base URL is http://host[:port][/path]: the proxy's upstream clients
    speak plain HTTP/1.1 (an https URL would go out as plain text to port 443)."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        raise ValueError(f"{flag} {url}: https is not supported to instances; the proxy "
                         "speaks plain HTTP to them (use http://, on a trusted network)")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{flag} {url}: expected http://host:port")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        raise ValueError(f"{flag} {url}: the port is not a number from 0 to 65535") from None


def defaults() -> dict[str, Any]:
    """Every knob's default, by field name (topology.Proxy takes its defaults from here)."""
    return {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
