"""The proxy's settings as one frozen value, built by __main__ or by tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ProxyConfig:
    """Where the instances are and how long each stage may take."""

    models: tuple[str, ...]
    """Model names served; a request naming another model gets a 404."""
    encode: tuple[str, ...] = ()
    pd: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    encode_timeout_s: float = 60.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 120.0
    """Deadline for decode's (or PD's) first content chunk; later ones use the idle timeout."""
    stream_idle_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    max_inflight: int = 256
    retry_after_s: int = 1
    metadata_rewrite: bool = True
    api_key: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    media_fetch_timeout_s: float = 10.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    eject_after: int = 3
    """Consecutive failed probes that take an instance out of rotation."""
    ec_protocol: Literal["shared", "mooncake"] = "shared"
    """How E hands encodings to PD: a shared store keyed by content, or Mooncake pushes."""
    ec_consumers: tuple[tuple[str, str], ...] = ()
    """Mooncake: (PD URL, its control socket `tcp://host:port`) for every PD instance."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model name is needed")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together")
        if self.pd and self.prefill:
            raise ValueError("--pd cannot be combined with --prefill/--decode")
        if not self.pd and not self.prefill:
            raise ValueError("give --pd, or --prefill and --decode")
        if self.ec_protocol not in ("shared", "mooncake"):
            raise ValueError(f"unknown EC protocol `{self.ec_protocol}`")
        if self.ec_protocol == "mooncake":
            self._check_mooncake()
        elif self.ec_consumers:
            raise ValueError("--ec-consumer needs --ec-protocol mooncake")

    def _check_mooncake(self) -> None:
        # vLLM's Mooncake consumer routing covers E+PD only (its example proxy refuses P|D).
        if self.is_split:
            raise ValueError("--ec-protocol mooncake supports --pd only, not --prefill/--decode")
        known = {url.rstrip("/") for url in self.pd}
        given = [url.rstrip("/") for url, _ in self.ec_consumers]
        for url in given:
            if url not in known:
                raise ValueError(f"--ec-consumer {url}: not one of the --pd URLs")
        missing = sorted(known - set(given))
        if missing:
            raise ValueError(f"--ec-protocol mooncake: --pd {missing[0]} needs an --ec-consumer")
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
    def is_split(self) -> bool:
        """True for P|D (prefill then decode), False for one PD stage."""
        return bool(self.prefill)

    @property
    def mode(self) -> str:
        core = "P|D" if self.is_split else "PD"
        return f"E|{core}" if self.encode else core
