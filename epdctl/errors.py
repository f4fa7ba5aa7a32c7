"""Expected failures, each with the exit code the CLI turns it into (stdlib only)."""

from __future__ import annotations


class EpdctlError(Exception):
    """Expected failure: shown as one message, no traceback."""

    exit_code = 1


class TopologyError(EpdctlError):
    """The topology file is missing, unreadable or invalid; nothing was launched."""


class PlanError(EpdctlError):
    """The topology is valid but cannot be placed on this machine (GPUs, ports)."""


class NotRunningError(EpdctlError):
    """No running topology was found in the state dir."""


class AlreadyRunningError(EpdctlError):
    """A topology with this name is already running."""


class StateError(EpdctlError):
    """The state dir or its state.json cannot be read."""


class CacheError(EpdctlError):
    """The EC store cannot be used (missing, too small, not writable)."""


class VerifyError(EpdctlError):
    """`verify`: an answer differs from the baseline's, or P/PD did not load from the EC store."""


class BenchError(EpdctlError):
    """`bench`: a bad option or workload, a workload run that failed, or arms that disagree."""


class StartupError(EpdctlError):
    """An instance exited or missed its ready deadline while starting."""

    exit_code = 3


class InstanceDiedError(EpdctlError):
    """An instance exited while the topology was serving in the foreground."""


class RenderError(EpdctlError):
    """The topology cannot be rendered for the requested target (e.g. Kubernetes)."""


class RestartError(EpdctlError):
    """`restart`: the instance cannot be restarted, or was not ready again in time."""


class ChangeError(EpdctlError):
    """`scale`, `switch`, `apply`: the change cannot be made, or did not complete."""
