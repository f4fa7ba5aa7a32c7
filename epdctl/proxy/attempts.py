"""The one attempt policy: every retry, fallback, replay and resume a request may get, and
what it has attempted so far. The stages ask; nothing else decides.

Before the client got a byte (every route, both EC protocols, pass-through too):
- The client's request as it came gets one more attempt, on another instance, only when
  the first instance did not answer at all (refused, reset before any response byte). A
  refusal, even a 5xx, is vLLM's answer and goes back as it is; a timeout is never tried
  again (it would double the wait).
- An attempt that rests on what the proxy arranged gets one more on any failure but a
  timeout: a body rewritten to E's metadata (PD may lack an item's entry: the next attempt
  sends the media; counted as a fallback) and Mooncake's pushes (pushed again, elsewhere).
- Each media item gets one more try on another encoder when the first did not answer at
  all; after that PD encodes it (or, under Mooncake, the request fails).

After an instance died (replay.py): a request whose PD (or P, or D) failed the way a death
fails it (no answer, a broken one, vLLM's dead-engine error) is replayed on another healthy
instance of that role, and a broken stream resumed there; MAX_REPLAYS in all, never again
onto an instance that failed it until that instance has begun a new life.

Not an attempt: the raw transport sends a request once more on a fresh connection when a
pooled connection turns out closed while idle before it took the request (transport/base.py):
no instance saw it.
"""

from __future__ import annotations

from epdctl.proxy.answer import StageFailed
from epdctl.proxy.errors import ENGINE_DEAD
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.trace import Trace
from epdctl.proxy.upstreams import Instance, Upstreams

ATTEMPTS = 2
"""Attempts of a stage before the client got a byte: the first, and one more elsewhere."""
ENCODE_ATTEMPTS = 2
"""Attempts of one media item on E: the first, and one more on another encoder."""
MAX_REPLAYS = 3
"""Replays and resumes of one request after instances died, all stages together."""


def is_replayable(failed: StageFailed) -> bool:
    """The instance gave no answer (refused, reset, died mid-answer) or vLLM said its engine
    is dead. Never a timeout (it would double the wait) nor vLLM's refusal of the request."""
    if failed.error is not None:
        return failed.error.kind in ("unavailable", "broken")
    return failed.status >= 500 and ENGINE_DEAD in failed.body


class Attempts:
    """One request's attempts: the instances that failed it, its replays, and the policy
    that says whether another attempt is due (counting it in the trace and the metrics)."""

    def __init__(self, trace: Trace, metrics: Metrics, upstreams: Upstreams) -> None:
        self.trace = trace
        self.metrics = metrics
        self.upstreams = upstreams
        self.avoid: dict[str, Instance] = {}
        """stage -> the instance whose attempt failed last (the next attempt goes elsewhere)."""
        self.replays = 0
        self._dead: dict[tuple[str, str], int] = {}
        """(stage, url) -> the instance's life when it last failed this request."""
        self._known = 0  # trace.failed entries already noted

    @staticmethod
    def may_fall_back(attempt: int, is_rewritten: bool) -> bool:
        """Whether attempt `attempt` (from 0) of a rewritten body has another after it: an
        error event early in its stream then fails it, instead of reaching the client."""
        return is_rewritten and attempt + 1 < ATTEMPTS

    def retry(self, failed: StageFailed, attempt: int, *, is_rewritten: bool = False,
              is_pushed: bool = False) -> None:
        """Note `failed` (attempt `attempt`, from 0) and raise it unless another attempt is
        due: for the client's request as it is, only when the instance did not answer; for
        a rewritten body or Mooncake's pushes, on any failure but a timeout."""
        self.avoid[failed.stage] = failed.inst
        self.trace.failed.append((failed.stage, failed.inst.url))
        if attempt + 1 >= ATTEMPTS or failed.is_timeout:
            raise failed
        if is_rewritten:
            self.trace.fallbacks.append("rewrite")
            self.metrics.fallbacks.labels("rewrite").inc()
        elif is_pushed or failed.is_retryable:
            self.trace.retries += 1
            self.metrics.retries.labels(failed.stage).inc()
        else:
            raise failed

    def encode_again(self, attempt: int, is_retryable: bool) -> bool:
        """Whether a media item whose attempt `attempt` (from 0) on E failed gets another
        (on another encoder): only when that encoder did not answer at all."""
        if not is_retryable or attempt + 1 >= ENCODE_ATTEMPTS:
            return False
        self.trace.retries += 1
        self.metrics.retries.labels("encode").inc()
        return True

    def may_replay(self, failed: StageFailed | None = None) -> bool:
        """Whether one more replay (or resume) is due: the budget has one left, and
        `failed`, where given, failed as an instance's death fails."""
        return self.replays < MAX_REPLAYS and (failed is None or is_replayable(failed))

    def replayed(self) -> int:
        """Spend one replay; how many so far."""
        self.replays += 1
        return self.replays

    def note_dead(self, stage: str, url: str | None = None) -> None:
        """The instances that failed this request since the last call, at their present
        life (and `url` of `stage`: a stream that broke)."""
        failed = self.trace.failed[self._known:]
        self._known = len(self.trace.failed)
        if url is not None:
            failed.append((stage, url))
        for failed_stage, failed_url in failed:
            pool = self.upstreams.pools.get(failed_stage)
            for inst in pool.instances if pool is not None else ():
                if inst.url == failed_url:
                    self._dead[(failed_stage, failed_url)] = inst.lives

    def is_dead(self, inst: Instance) -> bool:
        """Whether `inst` failed this request in its present life."""
        life = self._dead.get((inst.role, inst.url))
        return life is not None and inst.lives <= life
