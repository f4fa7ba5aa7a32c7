"""No request lost when an instance dies: a request whose PD (P, or D) failed before the
client got a byte goes to another healthy instance of that role, or waits for one to be
ready again (`replay_wait`); a stream broken after it began goes on there from the text
the client already has (resume.py), under the same id.

How many replays, and onto which instances, is the attempt policy's (attempts.py): at most
MAX_REPLAYS, never again onto an instance that failed the request until that instance has
begun a new life (a health probe failed, then passed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.answer import Answer, StageFailed
from epdctl.proxy.attempts import MAX_REPLAYS, Attempts
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.inflight import Body, Request
from epdctl.proxy.request.parse import CHAT, COMPLETIONS
from epdctl.proxy.request.shape import dumps, upstream_headers
from epdctl.proxy.sse import error_event
from epdctl.proxy.stages import resume, token_ids
from epdctl.proxy.stages.generate import Generator
from epdctl.proxy.transport import Upstream
from epdctl.proxy.upstreams import Instance, Upstreams

log = logging.getLogger("epdctl.proxy")
TOKENIZE_TIMEOUT_S = 10.0


class Replayer:
    """Runs the generator, replaying what an instance's death cut short."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, generator: Generator,
                 client: Upstream, metrics: Metrics) -> None:
        self.config = config
        self.upstreams = upstreams
        self.generator = generator
        self.client = client
        self.metrics = metrics

    async def run(self, req: Request) -> Answer:
        """Generator.run, then replays; the last failure raised when none is left."""
        req.trace.is_resumable = req.is_stream
        ids: token_ids.TokenIds | None = None
        as_dict = resumable = req.dict_of(req.fallback)  # what a resume starts from
        if req.is_stream and req.route in (CHAT, COMPLETIONS):
            if resume.why_not(as_dict, req.route) is None:
                req.first = token_ids.asked(req.first, req.dict_of(req.first))[0]
                req.fallback, is_ours = token_ids.asked(req.fallback, as_dict)
                ids = token_ids.TokenIds(req.route, is_ours)
                resumable = token_ids.asking(as_dict) if is_ours else as_dict
        try:
            answer = await self.generator.run(req)
        except StageFailed as failed:
            answer = await self._replay(failed, req)
        if answer.stream is not None:
            answer.stream = self._resuming(answer.stream, req, resumable, ids)
        return answer

    async def _replay(self, failed: StageFailed, req: Request) -> Answer:
        """Replay `req.fallback` until an instance answers; raises the last failure
        otherwise."""
        trace, attempts = req.trace, req.attempts
        while True:
            if not attempts.may_replay(failed):
                raise failed
            attempts.note_dead(failed.stage)
            inst = await self._instance(failed.stage, attempts)
            if inst is None:
                self._count(failed.stage, "no_instance")
                log.warning("rid=%s not replayed: no %s instance ready in %.0fs (%s)",
                            trace.rid, failed.stage, self.config.replay_wait_s, failed)
                raise failed
            replays = attempts.replayed()
            trace.notes.append(f"replayed={failed.stage}:{failed.inst.url}>{inst.url}")
            log.warning("rid=%s replay %d: %s, now on %s", trace.rid, replays, failed, inst.url)
            try:
                answer = await self.generator.attempt(req, req.fallback, False,
                                                       {failed.stage: inst})
            except StageFailed as again:
                trace.failed.append((again.stage, again.inst.url))
                self._count(failed.stage, "failed")
                failed = again
                continue
            self._count(failed.stage, "ok")
            return answer

    async def _instance(self, stage: str, attempts: Attempts) -> Instance | None:
        """A healthy instance of `stage` that has not failed this request (in its present
        life), the least busy; waits up to replay_wait for one (a health probe's news)."""
        pool = self.upstreams.pools[stage]
        deadline = time.monotonic() + self.config.replay_wait_s
        while True:
            ready = [i for i in pool.instances
                     if not i.is_ejected and not i.is_draining and not attempts.is_dead(i)]
            if ready:
                return min(ready, key=lambda i: i.outstanding)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.upstreams.revival(), left)
            except TimeoutError:
                return None

    async def _resuming(self, stream: AsyncIterator[bytes], req: Request,
                        body: dict[str, Any], ids: token_ids.TokenIds | None
                        ) -> AsyncIterator[bytes]:
        """The stream, whole events at a time (the ids of its tokens read, and taken out
        where the proxy asked for them); broken, it goes on elsewhere when it can, from
        `body` (the request as resumable: asking for the ids)."""
        trace = req.trace
        sent: list[bytes] = []
        tail = b""
        fix: Callable[[bytes], bytes] | None = None  # a continuation's chunks as the client's
        while True:
            try:
                async for chunk in stream:
                    whole, tail = resume.split_events(tail + chunk)
                    if ids is not None:
                        whole = ids(whole)
                    if not whole:
                        continue
                    dead = resume.dead_engine_at(whole)  # the events before it still go
                    if dead is not None:
                        whole = whole[:dead]
                    if whole:
                        if fix is not None:
                            whole = fix(whole)
                        sent.append(whole)
                        yield whole
                    if dead is not None:
                        raise UpstreamError(self.generator.decode_stage,
                                            trace.instances.get(self.generator.decode_stage, ""),
                                            "broken", "the engine died")
                if tail:
                    yield tail
                return
            except resume.Diverged as exc:
                await stream.aclose()  # type: ignore[attr-defined]
                self._count(self.generator.decode_stage, "failed")
                log.warning("rid=%s stream not resumed: the answer generated again differs "
                            "(%s)", trace.rid, exc)
                yield error_event(f"the answer generated again differs: {exc}")
                return
            except UpstreamError as exc:
                await stream.aclose()  # type: ignore[attr-defined]
                outcome = await self._go_on(exc, req, body, b"".join(sent), ids)
                if isinstance(outcome, bytes):
                    yield outcome
                    return
                stream, fix = outcome
                tail = b""  # half an event from the instance that died: never sent

    async def _go_on(self, exc: UpstreamError, req: Request, as_dict: dict[str, Any],
                     sent: bytes, ids: token_ids.TokenIds | None
                     ) -> bytes | tuple[AsyncIterator[bytes], Callable[[bytes], bytes]]:
        """The continuation's stream and how its chunks become the client's, or the bytes
        that end the client's stream: [DONE] (all was sent), or the error event (why: in
        the log). It goes on after the text sent only when that text tokenizes back into
        the very tokens generated (their ids came with the stream); else the same request
        again, less the text."""
        stage, route, trace, attempts = (self.generator.decode_stage, req.route, req.trace,
                                         req.attempts)
        so_far = resume.read_so_far(sent, route)
        if so_far.is_finished:
            self._count(stage, "ok")
            trace.notes.append("resumed=done")
            return b"data: [DONE]\n\n"
        why = so_far.why_not or resume.why_not(as_dict, route)
        if why is None and not attempts.may_replay():
            why = f"{MAX_REPLAYS} replays already"
        if why is not None:
            self._count(stage, "not_resumable")
            log.warning("rid=%s stream not resumed (%s): %s", trace.rid, why, exc)
            return error_event(str(exc))
        attempts.note_dead(stage, exc.url or trace.instances.get(stage))
        return await self._resume_on(exc, req, as_dict, so_far, ids)

    async def _resume_on(self, exc: UpstreamError, req: Request, as_dict: dict[str, Any],
                         so_far: resume.SoFar, ids: token_ids.TokenIds | None
                         ) -> bytes | tuple[AsyncIterator[bytes], Callable[[bytes], bytes]]:
        """_go_on's continuation on the next instance that takes it (waiting for one, and
        replaying while the attempt policy allows); the error event when none does."""
        stage, route, trace, attempts = (self.generator.decode_stage, req.route, req.trace,
                                         req.attempts)
        while True:
            inst = await self._instance(stage, attempts)
            if inst is None:
                self._count(stage, "no_instance")
                log.warning("rid=%s stream not resumed: no %s instance ready in %.0fs (%s)",
                            trace.rid, stage, self.config.replay_wait_s, exc)
                return error_event(str(exc))
            replays = attempts.replayed()
            try:
                tokens = await self._tokens(inst, as_dict, so_far.text, stage, trace.rid)
                new, fix, how = _continuation(req, as_dict, so_far, tokens, ids)
                if new is None:
                    self._count(stage, "ok")
                    return resume.length_finish(so_far, route) + b"data: [DONE]\n\n"
                trace.notes.append(f"replayed={stage}:{exc.url}>{inst.url}")
                log.warning("rid=%s resume %d %s %d chars (%d tokens): %s, now on %s",
                            trace.rid, replays, how, len(so_far.text),
                            len(tokens) if how == "after" else so_far.tokens, exc, inst.url)
                answer = await self.generator.attempt(req, new, False, {stage: inst})
            except (StageFailed, UpstreamError) as again:
                if isinstance(again, StageFailed):
                    trace.failed.append((again.stage, again.inst.url))
                else:
                    trace.failed.append((stage, inst.url))
                self._count(stage, "failed")
                if not attempts.may_replay(again if isinstance(again, StageFailed) else None):
                    log.warning("rid=%s stream not resumed: %s", trace.rid, again)
                    return error_event(str(exc))
                attempts.note_dead(stage)
                continue
            if answer.stream is None:  # a refusal as a whole body: nothing to go on with
                self._count(stage, "failed")
                log.warning("rid=%s stream not resumed: %s answered %d", trace.rid, inst.url,
                            answer.status)
                return error_event(str(exc))
            self._count(stage, "ok")
            return answer.stream, fix

    async def _tokens(self, inst: Instance, body: dict[str, Any], text: str,
                      stage: str, rid: str) -> list[int]:
        """The tokens the text sent so far is, by the instance's own /tokenize."""
        if not text:
            return []
        payload = dumps({"model": body.get("model"), "prompt": text,
                         "add_special_tokens": False})
        reply = await self.client.post(inst.url, "/tokenize", payload,
                                       upstream_headers(f"{rid}:tokenize"),
                                       TOKENIZE_TIMEOUT_S, stage)
        try:
            data = await reply.read()
        finally:
            await reply.close()
        try:
            tokens = jsonio.loads(data)["tokens"] if reply.status == 200 else None
        except (ValueError, KeyError, TypeError):
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise UpstreamError(stage, inst.url, "broken", f"/tokenize answered {reply.status}")
        return tokens

    def _count(self, stage: str, outcome: str) -> None:
        self.metrics.replays.labels(stage, outcome).inc()


def _continuation(req: Request, as_dict: dict[str, Any], so_far: resume.SoFar,
                  tokens: list[int], ids: token_ids.TokenIds | None
                  ) -> tuple[Body | None, Callable[[bytes], bytes], str]:
    """What goes on from the text sent, how its chunks become the client's, and how it goes
    on: "after" the text, when the text tokenizes back into the very tokens generated; else
    "again, less" the text (the same request). No body: nothing is left to generate."""
    route = req.route
    # A chat template may trim a prefix's trailing spaces: then the same way
    # as a text that would not tokenize back into the tokens sent.
    is_kept = route != CHAT or so_far.text == so_far.text.rstrip()
    if ids is not None and ids.is_seen and tokens == ids.ids and is_kept:
        count = len(tokens)
        new = resume.continuation(as_dict, route, so_far.text, count)
        fix: Callable[[bytes], bytes] = functools.partial(resume.adjust, sent_tokens=count,
                                                          state={})
        return new, fix, "after"
    # It would tokenize otherwise: the same request again, less the text.
    if ids is not None:
        ids.restart()
    return req.fallback, resume.Skip(so_far.text, route), "again, less"
