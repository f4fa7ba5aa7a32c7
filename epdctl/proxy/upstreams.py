"""Instance pools per role: least-outstanding picks (by key where one is given), health
probes, ejection."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from epdctl.proxy.config import ProxyConfig

log = logging.getLogger("epdctl.proxy")
# A keyed pick keeps to the key's instance unless it has more than this many requests in
# flight beyond the least busy one: repeats meet E's own caches, yet one hot key cannot
# queue behind a busy encoder while another idles.
KEY_AFFINITY_SLACK = 2


@dataclass(eq=False)
class Instance:
    """One engine instance and what the proxy knows about it right now."""

    url: str
    role: str
    outstanding: int = 0
    failures: int = 0
    """Consecutive failed health probes."""
    is_ejected: bool = False
    lives: int = 0
    """Probes that succeeded after a failed one: a new life (a restart) begins with each."""
    is_draining: bool = False
    """Sent nothing new until re-admitted (`epdctl restart`): what it has in flight ends."""


@dataclass(eq=False)
class Pool:
    """The instances of one role."""

    role: str
    instances: list[Instance]
    _turn: int = field(default=0, repr=False)
    draining: int = 0
    """How many of its instances are draining (most of the time none: nothing to look at)."""

    def pick(self, avoid: Instance | None = None, key: str | None = None) -> Instance:
        """Least outstanding requests among healthy instances, other than `avoid` if possible.

        Ejected instances are used only when no healthy one is left; ties rotate, so equal
        load spreads instead of piling onto the first instance. With a `key`: the candidate
        rendezvous hashing gives it (the same one while it stays healthy, and again when it
        comes back), unless it is busier than the least busy by more than the slack.
        """
        pool = self.instances
        healthy = [i for i in pool if not i.is_ejected and not i.is_draining]
        candidates = [i for i in healthy if i is not avoid] or healthy or \
            [i for i in pool if i is not avoid] or pool
        n = len(candidates)
        if key is not None and n > 1:
            chosen = max(candidates, key=lambda i: _score(i.url, key))
            if chosen.outstanding <= min(i.outstanding for i in candidates) + KEY_AFFINITY_SLACK:
                return chosen
        self._turn = (self._turn + 1) % n if n > 1 else 0
        best = candidates[self._turn]
        for k in range(1, n):
            inst = candidates[(self._turn + k) % n]
            if inst.outstanding < best.outstanding:
                best = inst
        return best

    @property
    def healthy(self) -> list[Instance]:
        """The instances that take new requests: not ejected, not draining."""
        return [i for i in self.instances if not i.is_ejected and not i.is_draining]

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url.rstrip("/")), None)


def _score(url: str, key: str) -> bytes:
    """Rendezvous weight of `key` on the instance at `url` (highest wins)."""
    return hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()


class Upstreams:
    """All pools of a topology plus the health loop that ejects and re-admits instances."""

    def __init__(self, config: ProxyConfig) -> None:
        self.eject_after = config.eject_after
        roles = {"encode": config.encode, "prefill_decode": config.prefill_decode,
                 "prefill": config.prefill, "decode": config.decode}
        self.pools = {role: Pool(role, [Instance(u.rstrip("/"), role) for u in urls])
                      for role, urls in roles.items() if urls}
        # Encoders are optional: without one, PD encodes the media itself.
        self.required = [r for r in ("prefill_decode", "prefill", "decode") if r in self.pools]
        self.revived: set[asyncio.Future[None]] = set()
        """Set when an instance begins a new life or is re-admitted after a drain (replay.py
        and generate.py wait on them)."""

    def find(self, url: str) -> tuple[Pool, Instance] | None:
        """The pool and instance at `url`, if the proxy routes to it."""
        for pool in self.pools.values():
            inst = pool.find(url)
            if inst is not None:
                return pool, inst
        return None

    def add(self, role: str, url: str) -> tuple[Pool, Instance]:
        """Route to a new instance of `role` from now on (`epdctl scale`, `switch`, `apply`):
        it is probed with the others, and whoever waits for an instance looks again. One
        already routed to is kept as it is. KeyError: the proxy has no pool of `role` (a
        topology's roles are fixed while it runs: they decide each request's path)."""
        pool = self.pools[role]
        found = self.find(url)
        if found is not None:
            return found
        inst = Instance(url.rstrip("/"), role)
        pool.instances.append(inst)
        log.warning("adding %s instance %s", role, inst.url)
        self._wake()
        return pool, inst

    def remove(self, pool: Pool, inst: Instance) -> None:
        """Route nothing more to `inst` (what it has in flight goes on). ValueError: it is
        the last of its role (every request of the role would have nowhere to go)."""
        if pool.instances == [inst]:
            raise ValueError(f"{inst.url} is the only {pool.role} instance")
        pool.instances.remove(inst)
        if inst.is_draining:
            pool.draining -= 1
        log.warning("removed %s instance %s", inst.role, inst.url)

    def set_draining(self, pool: Pool, inst: Instance, is_draining: bool) -> None:
        """Stop sending `inst` new requests, or take it back (then whoever waits for an
        instance of its role looks again)."""
        if inst.is_draining == is_draining:
            return
        inst.is_draining = is_draining
        pool.draining += 1 if is_draining else -1
        log.warning("%s %s instance %s", "draining" if is_draining else "re-admitting",
                    inst.role, inst.url)
        if not is_draining:
            self._wake()

    async def revival(self) -> None:
        """Until an instance begins a new life or is re-admitted (the caller bounds the
        wait)."""
        waiter = asyncio.get_running_loop().create_future()
        self.revived.add(waiter)
        try:
            await waiter
        finally:
            self.revived.discard(waiter)

    def _wake(self) -> None:
        for waiter in self.revived:
            if not waiter.done():
                waiter.set_result(None)

    def record_probe(self, inst: Instance, is_ok: bool) -> None:
        """Eject after `eject_after` consecutive failures; one success re-admits."""
        if is_ok:
            if inst.is_ejected:
                log.warning("re-admitting %s instance %s", inst.role, inst.url)
            if inst.failures:
                inst.lives += 1
                self._wake()
            inst.failures = 0
            inst.is_ejected = False
            return
        inst.failures += 1
        if not inst.is_ejected and inst.failures >= self.eject_after:
            inst.is_ejected = True
            log.warning("ejecting %s instance %s after %d failed health probes",
                        inst.role, inst.url, inst.failures)

    async def probe_all(self, probe: Callable[[str], Awaitable[bool]]) -> None:
        """Probe every instance's /health in parallel."""
        instances = [i for pool in self.pools.values() for i in pool.instances]
        results = await asyncio.gather(*(probe(i.url + "/health") for i in instances),
                                       return_exceptions=True)
        for inst, result in zip(instances, results, strict=True):
            self.record_probe(inst, result is True)

    async def run_health_checks(self, probe: Callable[[str], Awaitable[bool]],
                                interval_s: float) -> None:
        """Probe forever; started as a task next to the server, cancelled with it."""
        while True:
            try:
                await self.probe_all(probe)
            except Exception:  # a probe bug must not stop health checking for good
                log.exception("health probe round failed")
            await asyncio.sleep(interval_s)

    def report(self, *, with_urls: bool = True) -> tuple[bool, dict[str, object]]:
        """Whether every required role has a healthy instance, and who is in and out: their
        URLs, or (`with_urls=False`) how many."""
        roles: dict[str, dict[str, object]] = {}
        for role, pool in self.pools.items():
            ins = [i.url for i in pool.instances if not i.is_ejected]
            outs = [i.url for i in pool.instances if i.is_ejected]
            roles[role] = {"in": ins, "out": outs} if with_urls else {"in": len(ins),
                                                                      "out": len(outs)}
            if pool.draining:  # in, yet sent nothing new: a request waits for it (replay_wait)
                draining = [i.url for i in pool.instances if i.is_draining]
                roles[role]["draining"] = draining if with_urls else len(draining)
        # A role whose instances all drain is not down: its requests wait for one.
        is_ok = all(any(not i.is_ejected for i in self.pools[r].instances)
                    for r in self.required)
        degraded = any(pool.healthy != pool.instances for pool in self.pools.values())
        status = "unavailable" if not is_ok else "degraded" if degraded else "ok"
        return is_ok, {"status": status, "roles": roles}
