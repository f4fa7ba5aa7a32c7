"""The proxy's drain controls (server/admin.py), on each production client: the whole proxy
(`down --drain`: nothing new admitted, what is in flight finishes) and one instance
(`restart`: its role's others take its requests, or they wait for it)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.proxy.fakes import MODEL, STREAM, completion
from tests.waits import until

pytestmark = pytest.mark.anyio
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def held(release: asyncio.Event, entered: list[str]) -> Any:
    """A PD handler that answers once `release` is set."""
    async def answer(seen: Any) -> httpx.Response:
        entered.append(seen.instance)
        await release.wait()
        if seen.body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=STREAM)
        return httpx.Response(200, json=completion("late"))
    return answer


async def test_a_drain_refuses_new_requests_and_waits_for_those_in_flight(rig_factory):
    rig = rig_factory()
    release, entered = asyncio.Event(), []
    rig.fakes.then("pd0", held(release, entered), held(release, entered))
    plain = asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=CHAT))
    streamed = asyncio.ensure_future(rig.client.post("/v1/chat/completions",
                                                     json={**CHAT, "stream": True}))
    await until(lambda: len(entered) == 2, "both requests at PD")
    drain = asyncio.ensure_future(rig.client.post("/epdctl/drain", json={"seconds": 30}))
    await until(lambda: rig.proxy.is_draining, "the proxy draining")

    refused = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == str(rig.config.retry_after_s)
    assert "draining" in refused.json()["error"]["message"]
    health = await rig.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert not drain.done()

    release.set()
    answered = await asyncio.wait_for(plain, 10)
    assert answered.status_code == 200
    assert answered.json()["choices"][0]["message"]["content"] == "late"
    stream = await asyncio.wait_for(streamed, 10)
    assert stream.status_code == 200 and stream.content == STREAM  # whole, [DONE] included
    done = await asyncio.wait_for(drain, 10)
    assert done.status_code == 200
    assert done.json() == {"finished": 2, "in_flight": 0}
    assert rig.fakes.posts("pd") and len(rig.fakes.posts("pd")) == 2  # the refused one: none


async def test_a_drain_ends_at_its_deadline_and_says_how_many_are_left(rig_factory):
    rig = rig_factory()
    release, entered = asyncio.Event(), []
    rig.fakes.then("pd0", held(release, entered))
    pending = asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=CHAT))
    await until(lambda: entered, "the request at PD")
    done = await rig.client.post("/epdctl/drain", json={"seconds": 0.2})
    assert done.json() == {"finished": 0, "in_flight": 1}
    release.set()
    assert (await asyncio.wait_for(pending, 10)).status_code == 200


async def test_a_drained_instance_gets_nothing_new_until_admitted(rig_factory):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"))
    release, entered = asyncio.Event(), []
    rig.fakes.then("pd0", held(release, entered))
    rig.fakes.then("pd1", held(release, entered))
    first = [asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=CHAT))
             for _ in range(2)]
    await until(lambda: sorted(entered) == ["pd0", "pd1"], "one request on each PD")
    drain = asyncio.ensure_future(rig.client.post(
        "/epdctl/instances/drain", json={"url": "http://pd0", "seconds": 30}))
    pool = rig.proxy.upstreams.pools["prefill_decode"]
    await until(lambda: pool.draining == 1, "pd0 draining")
    health = (await rig.client.get("/health")).json()
    assert health["status"] == "degraded"
    assert health["roles"]["prefill_decode"]["draining"] == ["http://pd0"]

    before = len(rig.fakes.to("pd0"))
    answers = await asyncio.gather(*(rig.client.post("/v1/chat/completions", json=CHAT)
                                     for _ in range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert len(rig.fakes.to("pd0")) == before  # all six on pd1
    assert not drain.done()
    release.set()
    assert [(await f).status_code for f in first] == [200, 200]
    assert (await asyncio.wait_for(drain, 10)).json() == {"finished": 1, "in_flight": 0}

    admitted = await rig.client.post("/epdctl/instances/admit", json={"url": "http://pd0"})
    assert admitted.json() == {"url": "http://pd0", "role": "prefill_decode"}
    await asyncio.gather(*(rig.client.post("/v1/chat/completions", json=CHAT)
                           for _ in range(4)))
    assert len(rig.fakes.to("pd0")) > before  # pd0 takes requests again


async def test_with_its_only_instance_draining_a_request_waits_for_it(rig_factory):
    rig = rig_factory(replay_wait_s=30)
    await rig.client.post("/epdctl/instances/drain", json={"url": "http://pd0", "seconds": 0})
    waiting = asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=CHAT))
    await until(lambda: rig.proxy.upstreams.revived, "the request waiting for an instance")
    assert not waiting.done() and rig.fakes.posts("pd") == []
    await rig.client.post("/epdctl/instances/admit", json={"url": "http://pd0"})
    answer = await asyncio.wait_for(waiting, 10)
    assert answer.status_code == 200 and len(rig.fakes.posts("pd")) == 1


async def test_with_its_only_instance_draining_past_replay_wait_a_request_gets_503(
        rig_factory):
    rig = rig_factory(replay_wait_s=0.2)
    await rig.client.post("/epdctl/instances/drain", json={"url": "http://pd0", "seconds": 0})
    answer = await asyncio.wait_for(rig.client.post("/v1/chat/completions", json=CHAT), 10)
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == str(rig.config.retry_after_s)
    assert "restarting" in answer.json()["error"]["message"]
    assert rig.fakes.posts("pd") == []


async def test_the_controls_need_the_key_and_say_what_is_wrong(rig_factory):
    rig = rig_factory(api_key="s3cret")
    assert (await rig.client.post("/epdctl/drain", json={})).status_code == 401
    key = {"authorization": "Bearer s3cret"}
    wrong = await rig.client.post("/epdctl/instances/drain", json={"url": "http://nowhere"},
                                  headers=key)
    assert wrong.status_code == 404 and "nowhere" in wrong.json()["error"]["message"]
    bad = await rig.client.post("/epdctl/drain", json={"seconds": "soon"}, headers=key)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seconds"
    assert (await rig.client.get("/epdctl/drain", headers=key)).status_code == 405
    assert not rig.proxy.is_draining


async def test_an_added_instance_takes_requests_and_a_removed_one_none(rig_factory):
    """`epdctl scale`'s controls: an instance added to a role's pool is picked from then on
    (and shows on /health); a removed one first finishes what it has in flight, then is sent
    nothing and is gone from /health."""
    rig = rig_factory(prefill_decode=("http://pd0",))
    added = await rig.client.post("/epdctl/instances/add",
                                  json={"url": "http://pd1/", "role": "prefill_decode"})
    assert added.json() == {"url": "http://pd1", "role": "prefill_decode", "instances": 2}
    again = await rig.client.post("/epdctl/instances/add",
                                  json={"url": "http://pd1", "role": "prefill_decode"})
    assert again.json()["instances"] == 2  # the same URL twice: one instance
    health = (await rig.client.get("/health")).json()
    assert health["roles"]["prefill_decode"]["in"] == ["http://pd0", "http://pd1"]
    answers = await asyncio.gather(*(rig.client.post("/v1/chat/completions", json=CHAT)
                                     for _ in range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert rig.fakes.to("pd1")  # the new one took some

    release, entered = asyncio.Event(), []
    rig.fakes.then("pd0", held(release, entered))
    rig.fakes.then("pd1", held(release, entered))
    first = [asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=CHAT))
             for _ in range(2)]
    await until(lambda: sorted(entered) == ["pd0", "pd1"], "one request on each PD")
    removing = asyncio.ensure_future(rig.client.post(
        "/epdctl/instances/remove", json={"url": "http://pd0", "seconds": 30}))
    pool = rig.proxy.upstreams.pools["prefill_decode"]
    await until(lambda: pool.draining == 1, "pd0 draining")
    assert not removing.done()
    release.set()
    assert [(await f).status_code for f in first] == [200, 200]
    assert (await asyncio.wait_for(removing, 10)).json() == {"finished": 1, "in_flight": 0}
    assert [i.url for i in pool.instances] == ["http://pd1"] and pool.draining == 0
    before = len(rig.fakes.to("pd0"))
    answers = await asyncio.gather(*(rig.client.post("/v1/chat/completions", json=CHAT)
                                     for _ in range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert len(rig.fakes.to("pd0")) == before
    health = (await rig.client.get("/health")).json()
    assert health["status"] == "ok" and health["roles"]["prefill_decode"]["in"] == [
        "http://pd1"]


async def test_adding_or_removing_what_cannot_change_is_refused(rig_factory):
    rig = rig_factory()
    last = await rig.client.post("/epdctl/instances/remove",
                                 json={"url": "http://pd0", "seconds": 0})
    assert last.status_code == 409 and "only prefill_decode" in last.json()["error"]["message"]
    role = await rig.client.post("/epdctl/instances/add",
                                 json={"url": "http://p0", "role": "prefill"})
    assert role.status_code == 409 and "routes no role 'prefill'" in role.json()["error"][
        "message"]
    bad = await rig.client.post("/epdctl/instances/add", json={"url": "pd1", "role": "encode"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    answer = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200  # pd0 still serves
