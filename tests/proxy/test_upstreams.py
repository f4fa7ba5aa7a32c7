"""Least-outstanding balancing and health ejection / re-admission."""

from __future__ import annotations

import pytest

from epdctl.proxy import ProxyConfig
from epdctl.proxy.upstreams import Upstreams

pytestmark = pytest.mark.anyio


def pools(**kwargs) -> Upstreams:
    kwargs.setdefault("prefill_decode", ("http://pd0",))
    return Upstreams(ProxyConfig(models=("m",), **kwargs))


def test_pick_prefers_least_outstanding():
    pool = pools(encode=("http://e0", "http://e1/", "http://e2")).pools["encode"]
    e0, e1, e2 = pool.instances
    assert e1.url == "http://e1"
    e0.outstanding, e1.outstanding, e2.outstanding = 3, 1, 2
    assert all(pool.pick() is e1 for _ in range(6))
    e1.outstanding = 5
    assert pool.pick() is e2


def test_ties_rotate_instead_of_piling_on_one():
    pool = pools(encode=("http://e0", "http://e1", "http://e2")).pools["encode"]
    picks = [pool.pick().url for _ in range(6)]
    assert sorted(set(picks)) == ["http://e0", "http://e1", "http://e2"]


def test_pick_avoids_the_failed_instance_when_another_exists():
    pool = pools(encode=("http://e0", "http://e1")).pools["encode"]
    e0, e1 = pool.instances
    e1.outstanding = 10
    assert pool.pick(avoid=e0) is e1
    single = pools().pools["prefill_decode"]
    assert single.pick(avoid=single.instances[0]) is single.instances[0]


def test_ejected_instances_are_used_only_when_nothing_healthy_is_left():
    ups = pools(encode=("http://e0", "http://e1"))
    pool = ups.pools["encode"]
    e0, e1 = pool.instances
    e1.outstanding = 10
    for _ in range(ups.eject_after):
        ups.record_probe(e0, False)
    assert e0.is_ejected
    assert all(pool.pick() is e1 for _ in range(5))
    assert pool.pick(avoid=e1) is e1  # avoiding e1 still never means using ejected e0
    ups.record_probe(e1, False), ups.record_probe(e1, False), ups.record_probe(e1, False)
    assert pool.pick() in (e0, e1)  # all out: best effort


async def test_probe_all_ejects_after_n_failures_and_readmits_on_success():
    ups = pools(encode=("http://e0",), eject_after=2)
    e0 = ups.pools["encode"].instances[0]
    state = {"up": False}
    probed: list[str] = []

    async def probe(url: str) -> bool:
        probed.append(url)
        if url.startswith("http://pd0"):
            raise OSError("probe crashed")  # counts as a failure, never escapes
        return state["up"]

    await ups.probe_all(probe)
    assert sorted(probed) == ["http://e0/health", "http://pd0/health"]
    assert not e0.is_ejected and e0.failures == 1
    await ups.probe_all(probe)
    assert e0.is_ejected
    ok, report = ups.report()
    assert not ok and report["status"] == "unavailable"
    assert report["roles"]["encode"] == {"in": [], "out": ["http://e0"]}
    state["up"] = True
    await ups.probe_all(probe)
    assert not e0.is_ejected and e0.failures == 0


def test_report_encoders_are_optional_but_pd_is_required():
    ups = pools(encode=("http://e0",))
    for _ in range(3):
        ups.record_probe(ups.pools["encode"].instances[0], False)
    ok, report = ups.report()
    assert ok and report["status"] == "degraded"
    ups2 = pools(prefill=("http://p0",), decode=("http://d0",), prefill_decode=())
    assert ups2.required == ["prefill", "decode"]
    for _ in range(3):
        ups2.record_probe(ups2.pools["decode"].instances[0], False)
    assert ups2.report()[0] is False


def test_keyed_picks_stay_put_when_an_encoder_leaves_and_come_back_with_it():
    ups = pools(encode=("http://e0", "http://e1", "http://e2"))
    pool = ups.pools["encode"]
    keys = [f"key-{n}" for n in range(300)]
    before = {k: pool.pick(key=k) for k in keys}
    assert all(pool.pick(key=k) is before[k] for k in keys)  # the same one every time
    counts = {inst.url: sum(1 for v in before.values() if v is inst) for inst in pool.instances}
    assert all(60 < n < 140 for n in counts.values()), counts  # and spread over all three
    e1 = pool.instances[1]
    for _ in range(ups.eject_after):
        ups.record_probe(e1, False)
    during = {k: pool.pick(key=k) for k in keys}
    # Only e1's keys move (spread over the others); every other key stays where it was.
    assert all(during[k] is before[k] for k in keys if before[k] is not e1)
    moved = {during[k].url for k in keys if before[k] is e1}
    assert moved == {"http://e0", "http://e2"}
    ups.record_probe(e1, True)
    assert {k: pool.pick(key=k) for k in keys} == before


def test_a_keyed_pick_leaves_its_encoder_when_it_is_busier_than_the_slack():
    from epdctl.proxy.upstreams import KEY_AFFINITY_SLACK

    pool = pools(encode=("http://e0", "http://e1")).pools["encode"]
    home = pool.pick(key="k")
    other = next(i for i in pool.instances if i is not home)
    home.outstanding = KEY_AFFINITY_SLACK
    assert pool.pick(key="k") is home  # busier, but within the slack
    home.outstanding = KEY_AFFINITY_SLACK + 1
    assert pool.pick(key="k") is other
    other.outstanding = 1
    assert pool.pick(key="k") is home
    assert pool.pick(avoid=home, key="k") is other  # a retry goes elsewhere
