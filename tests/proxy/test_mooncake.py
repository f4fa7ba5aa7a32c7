"""--ec-protocol mooncake: PD first, E pushes into it, transfer ids on both sides, retries."""

from __future__ import annotations

import httpx
import pytest

from epdctl.proxy import ProxyConfig
from epdctl.proxy.__main__ import parse_args
from epdctl.proxy.request.media import content_key
from tests.proxy.fakes import (
    MODEL,
    PNG,
    STREAM,
    Fakes,
    Seen,
    chat_chunk,
    image_part,
    sse,
    sse_response,
)

pytestmark = pytest.mark.anyio
KEY = content_key("image", PNG)
KEY2 = content_key("image", PNG + b"2")
GRID = {"image_grid_thw": [1, 4, 4]}
ZMQ = {"pd0": "tcp://pd0.svc:14579", "pd1": "tcp://pd1.svc:14579"}
MOONCAKE = {"ec_protocol": "mooncake",
            "ec_consumers": (("http://pd0", ZMQ["pd0"]), ("http://pd1/", ZMQ["pd1"]))}


def producer_reply(seen: Seen, metadata: dict | None = None) -> httpx.Response:
    """E as vLLM's ECMooncakeConnector answers: its key, metadata and the echoed transfer id."""
    [item] = seen.body["ec_transfer_params"]["ec_items"]
    key = seen.body["messages"][0]["content"][0]["uuid"]
    entry = {"modality": "image", "item_indices": [0], "metadata": metadata or {},
             "transfer_id": item["transfer_id"]}
    return httpx.Response(200, json={"id": "e", "choices": [],
                                     "ec_transfer_params": {key: entry}})


def fail(status: int):
    return lambda seen: httpx.Response(status, json={"error": {
        "message": "EC transfer unavailable", "type": "InternalServerError", "code": status}})


def _rig(rig_factory, fakes: Fakes, *, encoders: int = 1, replies: int = 8, **kwargs):
    for n in range(encoders):
        fakes.then(f"e{n}", *([producer_reply] * replies))
    encode = tuple(f"http://e{n}" for n in range(encoders))
    return rig_factory(fakes, encode=encode, prefill_decode=("http://pd0", "http://pd1"),
                       **{**MOONCAKE, **kwargs})


def _pushes(fakes: Fakes) -> list[tuple[str, str]]:
    """(consumer_zmq, transfer_id) of every E sub-request, in arrival order."""
    out = []
    for seen in fakes.posts("e"):
        params = seen.body["ec_transfer_params"]
        [item] = params["ec_items"]
        assert set(params) == {"consumer_zmq", "ec_items"} and set(item) == {"transfer_id"}
        out.append((params["consumer_zmq"], item["transfer_id"]))
    return out


async def test_e_pushes_to_the_chosen_pd_and_pd_waits_for_the_same_transfer_id(rig_factory):
    fakes = Fakes()
    rig = _rig(rig_factory, fakes)
    r = await rig.chat([{"type": "text", "text": "what?"}, image_part()], max_tokens=3)
    assert r.status_code == 200
    [pd] = fakes.posts("pd")
    [(consumer, tid)] = _pushes(fakes)
    assert consumer == ZMQ[pd.instance]  # PD was chosen before E was called
    [enc] = fakes.posts("e")
    assert enc.body == {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": [{**image_part(), "uuid": KEY}]}],
        "ec_transfer_params": {"consumer_zmq": consumer, "ec_items": [{"transfer_id": tid}]}}
    # No metadata from E: PD gets the keyed media, E's entry and the transfer it waits for.
    assert pd.body["messages"][0]["content"][1] == {**image_part(), "uuid": KEY}
    assert pd.body["max_tokens"] == 3
    assert pd.body["ec_transfer_params"] == {
        KEY: {"modality": "image", "item_indices": [0], "metadata": {}, "transfer_id": tid},
        "ec_items": [{"mm_hash": KEY, "transfer_id": tid}]}
    assert len(tid) == 32 and int(tid, 16) >= 0


async def test_responses_images_are_pushed_to_the_chosen_pd_too(rig_factory):
    """/v1/responses: E gets the chat request it gets for chat, PD the input keyed, with
    E's entry and the transfer to wait for (vLLM 0.33 reads a Responses request's
    ec_transfer_params)."""
    fakes = Fakes()
    rig = _rig(rig_factory, fakes, replies=0, metadata_rewrite=True)
    fakes.then("e0", lambda seen: producer_reply(seen, GRID))  # no rewrite on this route
    url = image_part()["image_url"]["url"]
    body = {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": url}]}]}
    r = await rig.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    [pd] = fakes.posts("pd")
    [(consumer, tid)] = _pushes(fakes)
    assert consumer == ZMQ[pd.instance]
    [enc] = fakes.posts("e")
    assert enc.body["messages"] == [{"role": "user", "content": [{**image_part(), "uuid": KEY}]}]
    assert pd.body["input"][0]["content"][1] == {"type": "input_image", "image_url": url,
                                                 "uuid": KEY}
    assert pd.body["ec_transfer_params"] == {
        KEY: {"modality": "image", "item_indices": [0], "metadata": GRID, "transfer_id": tid},
        "ec_items": [{"mm_hash": KEY, "transfer_id": tid}]}
    unkeyed = {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "file:///tmp/cat.png"}]}]}
    r = await rig.client.post("/v1/responses", json=unkeyed)
    assert r.status_code == 400 and "uuid" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "input"


async def test_the_chosen_pd_counts_the_request_while_e_runs(rig_factory):
    fakes = Fakes()
    rig = rig_factory(fakes, encode=("http://e0",), prefill_decode=("http://pd0", "http://pd1"),
                      **MOONCAKE)
    seen_load = []

    def reply(seen):
        pools = rig.proxy.upstreams.pools["prefill_decode"].instances
        seen_load.append({i.url.removeprefix("http://"): i.outstanding for i in pools})
        return producer_reply(seen)

    fakes.then("e0", reply)
    assert (await rig.chat([image_part()])).status_code == 200
    [pd] = fakes.posts("pd")
    assert seen_load == [{pd.instance: 1, ("pd1" if pd.instance == "pd0" else "pd0"): 0}]


async def test_ids_are_unique_per_item_and_shared_by_repeats_of_one_item(rig_factory):
    fakes = Fakes()
    rig = _rig(rig_factory, fakes, encoders=2)
    other = image_part(PNG + b"2")
    r = await rig.chat([image_part(), other, image_part()])
    assert r.status_code == 200
    pushes = _pushes(fakes)
    assert len(pushes) == 2 and len({tid for _, tid in pushes}) == 2
    [pd] = fakes.posts("pd")
    assert {zmq for zmq, _ in pushes} == {ZMQ[pd.instance]}
    by_key = {s.body["messages"][0]["content"][0]["uuid"]:
              s.body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
              for s in fakes.posts("e")}
    # One entry per media part, in request order: vLLM matches them by position first.
    assert pd.body["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": KEY, "transfer_id": by_key[KEY]},
        {"mm_hash": KEY2, "transfer_id": by_key[KEY2]},
        {"mm_hash": KEY, "transfer_id": by_key[KEY]}]


async def test_metadata_rewrite_sends_embeds_with_the_transfer_ids(rig_factory):
    fakes = Fakes()
    fakes.then("e0", lambda seen: producer_reply(seen, {"image_grid_thw": [[1, 4, 4]]}))
    rig = rig_factory(fakes, encode=("http://e0",), prefill_decode=("http://pd0", "http://pd1"),
                      **MOONCAKE)
    r = await rig.chat([image_part()], mm_processor_kwargs={"a": 1})
    assert r.status_code == 200
    [pd] = fakes.posts("pd")
    [(_, tid)] = _pushes(fakes)
    assert pd.body["messages"][0]["content"] == [
        {"type": "image_embeds", "image_embeds": GRID, "uuid": KEY}]
    assert "mm_processor_kwargs" not in pd.body
    assert pd.body["ec_transfer_params"]["ec_items"] == [{"mm_hash": KEY, "transfer_id": tid}]


async def test_without_a_key_from_e_the_entry_is_matched_by_position(rig_factory):
    fakes = Fakes()  # the default E answer: no transfer-aware params at all
    fakes.then("e0", lambda seen: httpx.Response(200, json={"id": "e", "choices": []}))
    rig = rig_factory(fakes, encode=("http://e0",), prefill_decode=("http://pd0", "http://pd1"),
                      **MOONCAKE)
    assert (await rig.chat([image_part()])).status_code == 200
    [(_, tid)] = _pushes(fakes)
    [pd] = fakes.posts("pd")
    assert pd.body["ec_transfer_params"] == {"ec_items": [{"transfer_id": tid}]}


def first_pd_fails(fakes: Fakes, answer) -> None:
    """Whichever PD gets the request first answers `answer`; later requests get the default."""
    calls = []

    def handler(seen):
        calls.append(seen.instance)
        return answer(seen) if len(calls) == 1 else None

    for pd in ("pd0", "pd1"):
        fakes.then(pd, handler, handler)


async def test_pd_500_retries_on_another_pd_and_re_encodes_for_it(rig_factory):
    fakes = Fakes()
    fakes.then("pd0", fail(500))
    rig = _rig(rig_factory, fakes, metadata_rewrite=False)
    pd0, pd1 = rig.proxy.upstreams.pools["prefill_decode"].instances
    pd1.outstanding = 5  # least outstanding picks pd0 first, and again unless it is avoided
    r = await rig.chat([image_part()])
    assert r.status_code == 200
    bad, good = fakes.posts("pd")
    assert (bad.instance, good.instance) == ("pd0", "pd1")
    (zmq1, tid1), (zmq2, tid2) = _pushes(fakes)
    assert (zmq1, zmq2) == (ZMQ[bad.instance], ZMQ[good.instance])
    assert tid1 != tid2
    assert bad.body["ec_transfer_params"]["ec_items"] == [{"mm_hash": KEY, "transfer_id": tid1}]
    assert good.body["ec_transfer_params"]["ec_items"] == [{"mm_hash": KEY, "transfer_id": tid2}]
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_retries_total{stage="prefill_decode"} 1.0' in metrics
    assert (pd0.outstanding, pd1.outstanding) == (0, 5)


async def test_rewritten_request_failing_is_resent_as_media_pushed_again(rig_factory):
    fakes = Fakes()
    for pd in ("pd0", "pd1"):
        fakes.then(pd, fail(400))
    fakes.then("e0", *[lambda seen: producer_reply(seen, GRID)] * 2)
    rig = rig_factory(fakes, encode=("http://e0",), prefill_decode=("http://pd0", "http://pd1"),
                      **MOONCAKE)
    r = await rig.chat([image_part()])
    assert r.status_code == 400  # the second PD's answer, passed through
    first, second = fakes.posts("pd")
    assert first.instance != second.instance
    assert first.body["messages"][0]["content"][0]["type"] == "image_embeds"
    assert second.body["messages"][0]["content"][0] == {**image_part(), "uuid": KEY}
    (_, tid1), (_, tid2) = _pushes(fakes)
    assert second.body["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": KEY, "transfer_id": tid2}]
    assert tid1 != tid2


async def test_stream_error_before_content_retries_with_a_fresh_push(rig_factory):
    fakes = Fakes()
    error = {"error": {"message": "EC transfer unavailable", "type": "InternalServerError",
                       "param": None, "code": 500}}
    bad = sse(chat_chunk("", role="assistant"), error, "[DONE]")
    first_pd_fails(fakes, lambda seen: sse_response(bad))
    rig = _rig(rig_factory, fakes, metadata_rewrite=False)
    r = await rig.chat([image_part()], stream=True)
    assert r.status_code == 200 and r.content == STREAM
    first, second = fakes.posts("pd")
    (zmq1, tid1), (zmq2, tid2) = _pushes(fakes)
    assert (zmq1, zmq2) == (ZMQ[first.instance], ZMQ[second.instance])
    assert zmq1 != zmq2 and tid1 != tid2
    assert second.body["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": KEY, "transfer_id": tid2}]


async def test_encoder_failure_fails_fast_instead_of_sending_raw_media(rig_factory):
    fakes = Fakes()
    fakes.down.update({"e0", "e1"})
    rig = rig_factory(fakes, encode=("http://e0", "http://e1"),
                      prefill_decode=("http://pd0", "http://pd1"), **MOONCAKE)
    r = await rig.chat([image_part()])
    assert r.status_code == 502
    assert (r.json()["error"]["code"], r.json()["error"]["type"]) == (502, "Bad Gateway")
    assert "cannot encode them itself" in r.json()["error"]["message"]
    assert len(fakes.posts("e")) == 2 and fakes.posts("pd") == []
    metrics = (await rig.client.get("/metrics")).text
    assert 'reason="encoder"' not in metrics  # nothing fell back
    assert all(i.outstanding == 0 for i in rig.proxy.upstreams.pools["prefill_decode"].instances)


async def test_ejected_encoders_are_still_tried(rig_factory):
    fakes = Fakes()
    rig = _rig(rig_factory, fakes, eject_after=1)
    fakes.down.add("e0")
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    fakes.down.clear()
    assert rig.proxy.upstreams.pools["encode"].healthy == []
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(_pushes(fakes)) == 1


async def test_media_without_a_key_is_refused(rig_factory):
    fakes = Fakes()
    rig = _rig(rig_factory, fakes)
    part = {"type": "image_url", "image_url": {"url": "file:///tmp/cat.png"}}
    r = await rig.chat([part])
    assert r.status_code == 400 and "uuid" in r.json()["error"]["message"]
    assert fakes.posts("e") == [] and fakes.posts("pd") == []
    assert (await rig.chat([{**part, "uuid": "cat"}])).status_code == 200


async def test_text_only_requests_skip_e(rig_factory):
    fakes = Fakes()
    rig = _rig(rig_factory, fakes)
    assert (await rig.chat("hello")).status_code == 200
    assert fakes.posts("e") == [] and "ec_transfer_params" not in fakes.posts("pd")[0].body


async def test_shared_protocol_sends_no_transfer_params(rig_factory):
    fakes = Fakes()
    rig = rig_factory(fakes, encode=("http://e0",))
    assert (await rig.chat([image_part()])).status_code == 200
    [enc] = fakes.posts("e")
    assert "ec_transfer_params" not in enc.body
    assert "ec_items" not in fakes.posts("pd")[0].body["ec_transfer_params"]


@pytest.mark.parametrize(("change", "message"), [
    ({"prefill_decode": (), "prefill": ("http://p0",), "decode": ("http://d0",)},
     "supports --prefill-decode only"),
    ({"ec_consumers": (("http://pd0", "tcp://a:1"),)},
     "--prefill-decode http://pd1 needs an --ec-consumer"),
    ({"ec_consumers": (*MOONCAKE["ec_consumers"], ("http://x", "tcp://x:1"))},
     "--ec-consumer http://x: not one of the --prefill-decode URLs"),
    ({"ec_consumers": (("http://pd0", "pd0:1"), ("http://pd1", "tcp://b:1"))},
     "is not tcp://host:port"),
    ({"ec_protocol": "shared"}, "--ec-consumer needs --ec-protocol mooncake"),
])
def test_config_is_checked(change, message):
    kwargs = {"models": (MODEL,), "encode": ("http://e0",),
              "prefill_decode": ("http://pd0", "http://pd1"), **MOONCAKE, **change}
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        ProxyConfig(**kwargs)


def test_cli_pairs_each_pd_url_with_its_control_socket(capsys):
    config = parse_args([
        "--model", MODEL, "--encode", "http://e0", "--prefill-decode", "http://pd-0.pd:8000",
        "--ec-protocol", "mooncake", "--ec-consumer", "http://pd-0.pd:8000=tcp://pd-0.pd:14579"])
    assert config.ec_protocol == "mooncake"
    assert config.consumer_zmq("http://pd-0.pd:8000") == "tcp://pd-0.pd:14579"
    assert parse_args(["--model", MODEL, "--prefill-decode", "http://p"]).ec_protocol == "shared"
    with pytest.raises(SystemExit):
        parse_args(["--model", MODEL, "--prefill-decode", "http://p", "--ec-protocol", "mooncake",
                    "--ec-consumer", "tcp://p:1"])
    assert "expected URL=tcp://host:port" in capsys.readouterr().err
