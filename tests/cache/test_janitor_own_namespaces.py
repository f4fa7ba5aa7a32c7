"""The janitor removes a namespace only when it is provably this topology's earlier one:
named `<topology>-<12 hex>` exactly and recorded by this topology's own runs. A name that
merely starts with `<topology>-` is another topology's and is never touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epdctl.cache.janitor import is_namespace_of, keep_topology_store
from epdctl.cache.store import Store
from epdctl.cache.store_root import earlier_namespaces, record_namespace
from tests.cache.conftest import payload

HEX, OLD_HEX = "0123456789ab", "ba9876543210"


def _namespace(root: Path, name: str) -> Store:
    store = Store(root, name).create()
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))
    old = 1e9  # long past any grace: only the namespace rule can keep it
    os.utime(store.entry_path("k"), (old, old))
    return store


def _pass(root: Path, topology: str, earlier: set[str]) -> None:
    keep_topology_store(root / f"{topology}-{HEX}", topology, earlier=earlier,
                        capacity_bytes=1 << 30, ttl_s=float("inf"), grace_s=0)


@pytest.mark.parametrize(("topology", "other"), [
    ("cpu-demo", f"cpu-demo-example-connector-{HEX}"),
    ("cpu-demo", f"cpu-demo-example-{OLD_HEX}"),
    ("qwen-vl", f"qwen-vl-1e1pd-{HEX}"),
])
def test_another_topology_whose_name_extends_ours_keeps_its_namespace(
    store_root: Path, topology: str, other: str
) -> None:
    _namespace(store_root, f"{topology}-{HEX}")
    theirs = _namespace(store_root, other)
    # Even a record that names it (a bug, a hand-edited file) does not make it ours.
    _pass(store_root, topology, earlier={other})
    assert theirs.has_entry("k") and theirs.root.is_dir()


def test_an_earlier_namespace_of_ours_goes_only_if_our_runs_recorded_it(
    store_root: Path, tmp_path: Path
) -> None:
    current = _namespace(store_root, f"cpu-demo-{HEX}")
    recorded = _namespace(store_root, f"cpu-demo-{OLD_HEX}")
    unrecorded = _namespace(store_root, "cpu-demo-fedcba987654")  # another state dir's run
    state_dir = tmp_path / "state" / "cpu-demo"
    state_dir.mkdir(parents=True, mode=0o700)
    record_namespace(state_dir, store_root, recorded.namespace)
    record_namespace(state_dir, store_root, current.namespace)
    assert earlier_namespaces(state_dir, store_root) == {current.namespace, recorded.namespace}
    _pass(store_root, "cpu-demo", earlier_namespaces(state_dir, store_root))
    assert not recorded.root.exists()
    assert current.has_entry("k") and unrecorded.has_entry("k")
    # Gone namespaces drop out of the record at the next run's claim.
    record_namespace(state_dir, store_root, current.namespace)
    assert earlier_namespaces(state_dir, store_root) == {current.namespace}


@pytest.mark.parametrize(("name", "is_ours"), [
    (f"cpu-demo-{HEX}", True),
    (f"cpu-demo-example-connector-{HEX}", False),
    (f"cpu-demo-{HEX}0", False),
    ("cpu-demo-0123456789AB", False),
    (f"cpu-demox{HEX}", False),
    (f"qwen-vl-1e1pd-{HEX}", False),
])
def test_a_namespace_of_a_topology_has_its_exact_form(name: str, is_ours: bool) -> None:
    assert is_namespace_of(name, "qwen-vl" if name.startswith("qwen") else "cpu-demo") is is_ours
