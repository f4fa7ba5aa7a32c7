"""topologies/cpu-demo.yaml and cpu-demo-example-connector.yaml at once, in one store root,
for real: through passes of cpu-demo's janitor each answers image requests as
before and keeps its entries (no namespace of one is another's), and `down` of one leaves
the other's store intact."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from epdctl.cache.store import Store
from epdctl.cache.store_root import record_namespace
from tests.harness import (
    TopologyRun,
    chat,
    copy_topology,
    image_data_url,
    make_image,
    topology_up,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
MODEL = "tiny-llava"
READY_TIMEOUT_S = 600
JANITOR_PASSES = 3
"""Passes of cpu-demo's janitor watched (one every supervisor.JANITOR_INTERVAL_S): each
sees the same files, the old ones already past every grace period."""


@pytest.fixture(scope="module")
def pair(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[TopologyRun, TopologyRun]]:
    """Both demos up under one state root, sharing one private store root."""
    tmp = tmp_path_factory.mktemp("two-topologies")
    root = Path(tempfile.mkdtemp(prefix="epdctl-test-", dir="/dev/shm"))
    state_root = tmp / "state"
    paths = [copy_topology(src, tmp, model=tiny_llava, cache_dir=root)
             for src in ("cpu-demo", "cpu-demo-example-connector")]
    assert yaml.safe_load(paths[1].read_text())["cache"]["connector"] == "ECExampleConnector"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)  # after both are stopped
        ours, example = (
            stack.enter_context(topology_up(path, root, state_root, timeout_s=READY_TIMEOUT_S,
                                            should_remove_cache=False))
            for path in paths)
        yield ours, example


def _entry_paths(ours: TopologyRun, example: TopologyRun, key: str) -> tuple[Path, Path]:
    from epdctl.cache.example_files import item_file
    from epdctl.cache.store import Store

    state = ours.state()
    mine = Path(Store(Path(state.store_dir).parent, state.namespace).entry_path(key))
    return mine, item_file(Path(example.state().store_dir), key)


def _janitor_pass(ours: TopologyRun) -> bool:
    """Observe one pass of cpu-demo's janitor: it removes an orphaned tmp file (its writer's
    pid is dead) planted in its namespace."""
    orphan = Path(ours.state().store_dir) / "tmp" / f"probe.999999999.{time.monotonic_ns()}"
    fd = os.open(orphan, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    return bool(wait_for(lambda: not orphan.exists(), timeout_s=60))


def test_both_answer_and_keep_their_entries_through_janitor_passes(
    pair: tuple[TopologyRun, TopologyRun],
) -> None:
    from epdctl.proxy.request.media import content_key

    ours, example = pair
    assert Path(ours.state().store_dir).parent == Path(example.state().store_dir).parent
    assert ours.state().namespace.startswith("cpu-demo-")
    assert example.state().namespace.startswith("cpu-demo-example")
    png = make_image(71)
    key, url = content_key("image", png), image_data_url(png)
    first = [chat(run.proxy_url, MODEL, image_urls=[url]) for run in pair]
    assert first[0] and first[0] == first[1]  # one model, one image: one answer
    mine, theirs = _entry_paths(ours, example, key)
    assert wait_for(mine.exists) and wait_for(theirs.exists)
    before = (mine.stat().st_ino, theirs.stat().st_ino)
    # Beside them: a namespace of a stopped `cpu-demo-example-connector` on epdctl's store
    # (a name cpu-demo's janitor once took for its own), and an earlier run's of cpu-demo,
    # recorded in its state dir: the janitor's one namespace to remove.
    bystander = _old_namespace(ours, f"cpu-demo-example-connector-{'ab' * 6}")
    earlier = _old_namespace(ours, f"cpu-demo-{'cd' * 6}")
    record_namespace(ours.run_dir, earlier.root.parent, earlier.namespace)
    for _ in range(JANITOR_PASSES):
        assert _janitor_pass(ours), "cpu-demo's janitor stopped running"
    assert (mine.stat().st_ino, theirs.stat().st_ino) == before  # the very same entries
    assert bystander.has_entry("k") and not earlier.root.exists()
    shutil.rmtree(bystander.root)  # so `down` can show the root goes once empty
    assert [chat(run.proxy_url, MODEL, image_urls=[url]) for run in pair] == first


def _old_namespace(ours: TopologyRun, name: str) -> Store:
    """A namespace with one entry past every grace period, in cpu-demo's store root."""
    store = Store(Path(ours.state().store_dir).parent, name).create()
    store.publish("k", b"\0" * 64, dtype="uint8", shape=(64,))
    os.utime(store.entry_path("k"), (1e9, 1e9))
    return store


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_another_user_gets_nothing_from_the_engines_of_the_demo_as_shipped(
    pair: tuple[TopologyRun, TopologyRun],
) -> None:
    """uid 65534, straight to each engine of cpu-demo as shipped (no proxy.api_key): 401 on
    every route but /health, issue 23's poisoning included (image X's bytes under image Y's
    content key: E would save X's embedding for every later client of Y); the proxy's open
    /health names no engine; the store cannot be listed; the run's key is in no output."""
    import http.client  # the attacker can import nothing once it is uid 65534
    import json
    import urllib.parse

    from epdctl.proxy.request.media import content_key
    from tests.attacker import as_nobody

    ours, example = pair
    state = ours.state()
    y = make_image(82)
    y_key = content_key("image", y)
    poison = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": image_data_url(make_image(81))},
                     "uuid": y_key}]}]})
    engines = {s.name: urllib.parse.urlsplit(s.url) for s in state.engines}
    proxy = urllib.parse.urlsplit(ours.proxy_url)
    ns_dir = Path(state.store_dir)
    base = os.open(ns_dir.parent.parent, os.O_RDONLY | os.O_DIRECTORY)  # /dev/shm

    def attack() -> dict:
        out: dict[str, object] = {}
        for name, url in engines.items():
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/invocations"),
                                 ("POST", "/tokenize"), ("GET", "/metrics"),
                                 ("GET", "/v1/models"), ("GET", "/health")):
                conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
                conn.request(method, path, poison if method == "POST" else None,
                             {"content-type": "application/json"})
                out[f"{name} {method} {path}"] = conn.getresponse().status
                conn.close()
        conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=60)
        conn.request("GET", "/health")
        out["proxy /health"] = conn.getresponse().read().decode()
        conn.close()
        out["control"] = "listed" if os.listdir(base) is not None else "?"
        for what, rel in (("root", ns_dir.parent.name), ("namespace",
                                                        f"{ns_dir.parent.name}/{ns_dir.name}")):
            try:
                os.listdir(os.open(rel, os.O_RDONLY, dir_fd=base))
                out[what] = "listed"
            except PermissionError:
                out[what] = "denied"
        return out

    try:
        seen = as_nobody(attack)
    finally:
        os.close(base)
    for name in engines:
        assert seen.pop(f"{name} GET /health") == 200
    health = json.loads(str(seen.pop("proxy /health")))
    assert health["status"] == "ok" and "http://" not in json.dumps(health), health
    assert (seen.pop("control"), seen.pop("root"), seen.pop("namespace")) == (
        "listed", "denied", "denied")
    assert seen and set(seen.values()) == {401}, seen
    mine, _ = _entry_paths(ours, example, y_key)
    assert not mine.exists()  # E never ran the poisoned request
    key = state.internal_key
    shown = [ours.cli(*args).stdout for args in (("status",), ("status", "--json"),
                                                 ("logs", "-n", "2000"),
                                                 ("up", str(ours.path), "--dry-run"))]
    logs = [p.read_text(errors="replace") for p in (ours.run_dir / "logs").iterdir()
            if p.is_file()]
    assert key and not any(key in text for text in shown + logs)


def test_down_of_one_leaves_the_others_store_intact(
    pair: tuple[TopologyRun, TopologyRun],
) -> None:
    from epdctl.proxy.request.media import content_key

    ours, example = pair
    png = make_image(72)
    key, url = content_key("image", png), image_data_url(png)
    answers = [chat(run.proxy_url, MODEL, image_urls=[url]) for run in pair]
    mine, theirs = _entry_paths(ours, example, key)
    assert wait_for(mine.exists) and wait_for(theirs.exists)
    ours_ns, example_ns = Path(ours.state().store_dir), Path(example.state().store_dir)
    result = example.cli("down", "--name", example.name, timeout_s=90)
    assert result.returncode == 0, result.stderr
    assert not example_ns.exists() and mine.exists()
    assert _janitor_pass(ours)
    assert chat(ours.proxy_url, MODEL, image_urls=[url]) == answers[0]
    result = ours.cli("down", "--name", ours.name, timeout_s=90)
    assert result.returncode == 0, result.stderr
    assert not ours_ns.exists() and not ours_ns.parent.exists()  # the root, once empty

