"""The proxy's settings as one frozen value, built by __main__ or by tests."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model name is needed")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together")
        if self.pd and self.prefill:
            raise ValueError("--pd cannot be combined with --prefill/--decode")
        if not self.pd and not self.prefill:
            raise ValueError("give --pd, or --prefill and --decode")

    @property
    def is_split(self) -> bool:
        """True for P|D (prefill then decode), False for one PD stage."""
        return bool(self.prefill)

    @property
    def mode(self) -> str:
        core = "P|D" if self.is_split else "PD"
        return f"E|{core}" if self.encode else core
