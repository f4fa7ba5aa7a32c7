"""No request lost when an instance dies: a request whose PD (P, or D) failed before the
client got a byte goes to another healthy instance of that role, or waits for one to be
ready again (`replay_wait`); a stream broken after it began goes on there from the text
the client already has (resume.py), under the same id.

Each request is replayed at most MAX_REPLAYS times, and never again onto an instance that
failed it until that instance has begun a new life (a health probe failed, then passed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.parse import CHAT, COMPLETIONS
from epdctl.proxy.request.shape import dumps, upstream_headers
from epdctl.proxy.sse import error_event
from epdctl.proxy.stages import resume, token_ids
from epdctl.proxy.stages.generate import Answer, Generator, StageFailed
from epdctl.proxy.trace import Trace
from epdctl.proxy.transport import Upstream
from epdctl.proxy.upstreams import Instance, Upstreams

log = logging.getLogger("epdctl.proxy")
MAX_REPLAYS = 3
"""Replays (and resumes) per request, all stages together."""
TOKENIZE_TIMEOUT_S = 10.0


def is_replayable(failed: StageFailed) -> bool:
    """The instance gave no answer (refused, reset, died mid-answer) or vLLM said its engine
    is dead. Never a timeout (it would double the wait) nor vLLM's refusal of the request."""
    if failed.error is not None:
        return failed.error.kind in ("unavailable", "broken")
    return failed.status >= 500 and resume.ENGINE_DEAD in failed.body


class Replayer:
    """Runs the generator, replaying what an instance's death cut short."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, generator: Generator,
                 client: Upstream, metrics: Metrics) -> None:
        self.config = config
        self.upstreams = upstreams
        self.generator = generator
        self.client = client
        self.metrics = metrics

    async def run(self, route: str, first: dict[str, Any] | bytes,
                  second: dict[str, Any] | bytes, is_rewritten: bool, is_stream: bool,
                  trace: Trace) -> Answer:
        """Generator.run, then replays; the last failure raised when none is left."""
        state = _State(self.upstreams, trace)
        trace.is_resumable = is_stream
        ids: token_ids.TokenIds | None = None
        if is_stream and route in (CHAT, COMPLETIONS):
            as_dict = second if isinstance(second, dict) else jsonio.loads(second)
            if isinstance(as_dict, dict) and resume.why_not(as_dict, route) is None:
                first = token_ids.asked(first)[0]
                second, is_ours = token_ids.asked(second)
                ids = token_ids.TokenIds(route, is_ours)
        try:
            answer = await self.generator.run(route, first, second, is_rewritten, is_stream,
                                              trace)
        except StageFailed as failed:
            answer = await self._replay(failed, route, second, is_stream, trace, state)
        if answer.stream is not None:
            answer.stream = self._resuming(answer.stream, route, second, trace, state, ids)
        return answer

    async def _replay(self, failed: StageFailed, route: str, body: dict[str, Any] | bytes,
                      is_stream: bool, trace: Trace, state: _State) -> Answer:
        """Replay `body` until an instance answers; raises the last failure otherwise."""
        while True:
            if not is_replayable(failed) or state.replays >= MAX_REPLAYS:
                raise failed
            state.note_dead(failed.stage)
            inst = await self._instance(failed.stage, state)
            if inst is None:
                self._count(failed.stage, "no_instance")
                log.warning("rid=%s not replayed: no %s instance ready in %.0fs (%s)",
                            trace.rid, failed.stage, self.config.replay_wait_s, failed)
                raise failed
            state.replays += 1
            trace.notes.append(f"replayed={failed.stage}:{failed.inst.url}>{inst.url}")
            log.warning("rid=%s replay %d: %s, now on %s", trace.rid, state.replays, failed,
                        inst.url)
            try:
                answer = await self.generator.attempt(route, body, False, is_stream, trace,
                                                       {}, {failed.stage: inst})
            except StageFailed as again:
                trace.failed.append((again.stage, again.inst.url))
                self._count(failed.stage, "failed")
                failed = again
                continue
            self._count(failed.stage, "ok")
            return answer

    async def _instance(self, stage: str, state: _State) -> Instance | None:
        """A healthy instance of `stage` that has not failed this request (in its present
        life), the least busy; waits up to replay_wait for one (a health probe's news)."""
        pool = self.upstreams.pools[stage]
        deadline = time.monotonic() + self.config.replay_wait_s
        while True:
            ready = [i for i in pool.instances if not i.is_ejected and not state.is_dead(i)]
            if ready:
                return min(ready, key=lambda i: i.outstanding)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self.upstreams.revived.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                return None
            finally:
                self.upstreams.revived.discard(waiter)

    async def _resuming(self, stream: AsyncIterator[bytes], route: str,
                        body: dict[str, Any] | bytes, trace: Trace, state: _State,
                        ids: token_ids.TokenIds | None) -> AsyncIterator[bytes]:
        """The stream, whole events at a time (the ids of its tokens read, and taken out
        where the proxy asked for them); broken, it goes on elsewhere when it can."""
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
                    if resume.ENGINE_DEAD in whole and resume.is_dead_engine(whole):
                        raise UpstreamError(self.generator.decode_stage,
                                            trace.instances.get(self.generator.decode_stage, ""),
                                            "broken", "the engine died")
                    if fix is not None:
                        whole = fix(whole)
                    sent.append(whole)
                    yield whole
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
                outcome = await self._go_on(exc, route, body, b"".join(sent), trace, state,
                                            ids)
                if isinstance(outcome, bytes):
                    yield outcome
                    return
                stream, fix = outcome
                tail = b""  # half an event from the instance that died: never sent

    async def _go_on(self, exc: UpstreamError, route: str, body: dict[str, Any] | bytes,
                     sent: bytes, trace: Trace, state: _State, ids: token_ids.TokenIds | None
                     ) -> bytes | tuple[AsyncIterator[bytes], Callable[[bytes], bytes]]:
        """The continuation's stream and how its chunks become the client's, or the bytes
        that end the client's stream: [DONE] (all was sent), or the error event (why: in
        the log). It goes on after the text sent only when that text tokenizes back into
        the very tokens generated (their ids came with the stream); else the same request
        again, less the text."""
        stage = self.generator.decode_stage
        as_dict = body if isinstance(body, dict) else jsonio.loads(body)
        so_far = resume.read_so_far(sent, route)
        if so_far.is_finished:
            self._count(stage, "ok")
            trace.notes.append("resumed=done")
            return b"data: [DONE]\n\n"
        why = so_far.why_not or resume.why_not(as_dict, route)
        if why is None and state.replays >= MAX_REPLAYS:
            why = f"{MAX_REPLAYS} replays already"
        if why is not None:
            self._count(stage, "not_resumable")
            log.warning("rid=%s stream not resumed (%s): %s", trace.rid, why, exc)
            return error_event(str(exc))
        state.note_dead(stage, exc.url or trace.instances.get(stage))
        while True:
            inst = await self._instance(stage, state)
            if inst is None:
                self._count(stage, "no_instance")
                log.warning("rid=%s stream not resumed: no %s instance ready in %.0fs (%s)",
                            trace.rid, stage, self.config.replay_wait_s, exc)
                return error_event(str(exc))
            state.replays += 1
            try:
                tokens = await self._tokens(inst, as_dict, so_far.text, stage, trace)
                # A chat template may trim a prefix's trailing spaces: then the same way
                # as a text that would not tokenize back into the tokens sent.
                is_kept = route != CHAT or so_far.text == so_far.text.rstrip()
                if ids is not None and ids.is_seen and tokens == ids.ids and is_kept:
                    count = len(tokens)
                    new = resume.continuation(as_dict, route, so_far.text, count)
                    fix: Callable[[bytes], bytes] = functools.partial(resume.adjust,
                                                                      sent_tokens=count,
                                                                      state={})
                    how = "after"
                else:  # it would tokenize otherwise: the same request again, less the text
                    new, fix, how = as_dict, resume.Skip(so_far.text, route), "again, less"
                    if ids is not None:
                        ids.restart()
                if new is None:
                    self._count(stage, "ok")
                    return resume.length_finish(so_far, route) + b"data: [DONE]\n\n"
                trace.notes.append(f"replayed={stage}:{exc.url}>{inst.url}")
                log.warning("rid=%s resume %d %s %d chars (%d tokens): %s, now on %s",
                            trace.rid, state.replays, how, len(so_far.text),
                            len(tokens) if how == "after" else so_far.tokens, exc, inst.url)
                answer = await self.generator.attempt(route, new, False, True, trace, {},
                                                       {stage: inst})
            except (StageFailed, UpstreamError) as again:
                if isinstance(again, StageFailed):
                    trace.failed.append((again.stage, again.inst.url))
                else:
                    trace.failed.append((stage, inst.url))
                self._count(stage, "failed")
                if state.replays >= MAX_REPLAYS or (
                        isinstance(again, StageFailed) and not is_replayable(again)):
                    log.warning("rid=%s stream not resumed: %s", trace.rid, again)
                    return error_event(str(exc))
                state.note_dead(stage)
                continue
            if answer.stream is None:  # a refusal as a whole body: nothing to go on with
                self._count(stage, "failed")
                log.warning("rid=%s stream not resumed: %s answered %d", trace.rid, inst.url,
                            answer.status)
                return error_event(str(exc))
            self._count(stage, "ok")
            return answer.stream, fix

    async def _tokens(self, inst: Instance, body: dict[str, Any], text: str,
                      stage: str, trace: Trace) -> list[int]:
        """The tokens the text sent so far is, by the instance's own /tokenize."""
        if not text:
            return []
        payload = dumps({"model": body.get("model"), "prompt": text,
                         "add_special_tokens": False})
        reply = await self.client.post(inst.url, "/tokenize", payload,
                                       upstream_headers(f"{trace.rid}:tokenize"),
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


class _State:
    """One request's replays: how many, and which instance failed it in which life."""

    def __init__(self, upstreams: Upstreams, trace: Trace) -> None:
        self.upstreams = upstreams
        self.trace = trace
        self.replays = 0
        self.dead: dict[tuple[str, str], int] = {}
        """(stage, url) -> the instance's life when it last failed this request."""
        self._known = 0  # trace.failed entries already noted

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
                    self.dead[(failed_stage, failed_url)] = inst.lives

    def is_dead(self, inst: Instance) -> bool:
        life = self.dead.get((inst.role, inst.url))
        return life is not None and inst.lives <= life
