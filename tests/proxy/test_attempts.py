"""attempts.py, the one attempt policy, as logic: which failure gets another attempt, how
each is counted, the replay budget and an instance's lives. (The rig's tests show each rule
at work on the transports that ship: test_failures, test_replay, test_mooncake.)"""

from __future__ import annotations

import pytest

from epdctl.proxy.answer import StageFailed
from epdctl.proxy.attempts import ATTEMPTS, ENCODE_ATTEMPTS, MAX_REPLAYS, Attempts
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import ENGINE_DEAD, UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.trace import Trace
from epdctl.proxy.upstreams import Upstreams

PD = "prefill_decode"


@pytest.fixture
def attempts() -> Attempts:
    config = ProxyConfig(models=("m",), prefill_decode=("http://pd0", "http://pd1"))
    return Attempts(Trace("r", "/v1/chat/completions"), Metrics(), Upstreams(config))


def failure(attempts: Attempts, kind: str | None = None, status: int = 502,
            body: bytes = b"", n: int = 0) -> StageFailed:
    inst = attempts.upstreams.pools[PD].instances[n]
    error = UpstreamError(PD, inst.url, kind, "x") if kind else None
    return StageFailed(PD, inst, error=error, status=status, body=body)


def count(attempts: Attempts, name: str, *labels: str) -> float:
    return getattr(attempts.metrics, name).labels(*labels)._value.get()


def test_no_answer_gets_one_more_attempt_elsewhere(attempts):
    failed = failure(attempts, "unavailable")
    attempts.retry(failed, 0)
    assert attempts.avoid[PD] is failed.inst
    assert attempts.trace.retries == 1 and count(attempts, "retries", PD) == 1
    assert attempts.trace.failed == [(PD, "http://pd0")]
    with pytest.raises(StageFailed):  # the budget: ATTEMPTS in all
        attempts.retry(failure(attempts, "unavailable", n=1), ATTEMPTS - 1)


@pytest.mark.parametrize("failed", [
    {"status": 500, "body": b'{"error": "bad"}'},  # vLLM's answer: the client's
    {"kind": "timeout"},                            # would double the wait
    {"kind": "broken"},                             # it may have been acted on
])
def test_the_clients_request_as_it_is_gets_no_other_attempt(attempts, failed):
    with pytest.raises(StageFailed):
        attempts.retry(failure(attempts, **failed), 0)
    assert attempts.trace.retries == 0


def test_a_rewritten_body_falls_back_on_any_failure_but_a_timeout(attempts):
    attempts.retry(failure(attempts, status=400), 0, is_rewritten=True)
    assert attempts.trace.fallbacks == ["rewrite"] and count(attempts, "fallbacks", "rewrite") == 1
    with pytest.raises(StageFailed):
        attempts.retry(failure(attempts, "timeout"), 0, is_rewritten=True)
    assert Attempts.may_fall_back(0, True) and not Attempts.may_fall_back(ATTEMPTS - 1, True)
    assert not Attempts.may_fall_back(0, False)


def test_mooncake_pushes_are_made_again_on_a_refusal(attempts):
    attempts.retry(failure(attempts, status=500), 0, is_pushed=True)
    assert attempts.trace.retries == 1


def test_a_media_item_gets_one_more_encoder_only_when_the_first_did_not_answer(attempts):
    assert not attempts.encode_again(0, is_retryable=False)
    assert attempts.encode_again(0, is_retryable=True)
    assert not attempts.encode_again(ENCODE_ATTEMPTS - 1, is_retryable=True)
    assert count(attempts, "retries", "encode") == 1


def test_replays_are_for_deaths_and_within_the_budget(attempts):
    assert not attempts.may_replay(failure(attempts, status=500, body=b"bad request"))
    assert not attempts.may_replay(failure(attempts, "timeout"))
    dead = failure(attempts, status=500, body=ENGINE_DEAD)
    for _ in range(MAX_REPLAYS):
        assert attempts.may_replay(dead) and attempts.may_replay()
        attempts.replayed()
    assert not attempts.may_replay(dead) and not attempts.may_replay()


def test_an_instance_that_failed_the_request_is_dead_to_it_until_its_next_life(attempts):
    pd0, pd1 = attempts.upstreams.pools[PD].instances
    attempts.trace.failed.append((PD, pd0.url))
    attempts.note_dead(PD)
    assert attempts.is_dead(pd0) and not attempts.is_dead(pd1)
    pd0.lives += 1  # a probe failed, then passed: restarted
    assert not attempts.is_dead(pd0)
    attempts.note_dead(PD, pd1.url)  # a stream that broke on pd1
    assert attempts.is_dead(pd1)
