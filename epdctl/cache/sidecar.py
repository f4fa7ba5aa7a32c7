"""E's per-item metadata kept beside its entry (`entries/<key>.meta.json`), for the proxy.

The proxy sees E's answer, so the proxy writes it: when a later request's item is already in
the store, the proxy skips E and still has what E reported (e.g. Qwen2-VL's `image_grid_thw`)
to replace the media by `*_embeds` metadata. It also names the item's modality (image,
video, audio), which `cache inspect --entries` shows: the entry itself does not know it.
A sidecar without its entry means nothing: the janitor removes sidecars with their entries,
and orphans past the grace period.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from epdctl.cache._format import ENTRY_SUFFIX, key_filename
from epdctl.cache.store import TMP_TOKEN, Store
from epdctl.host import private

META_SUFFIX = ".meta.json"

_tmp_ids = itertools.count()


def meta_path(store: Store, key: str) -> str:
    return f"{store.entries}/{key_filename(key)}{META_SUFFIX}"


def sidecar_of(entry_path: str) -> str:
    """The sidecar path of an entry file."""
    return entry_path.removesuffix(ENTRY_SUFFIX) + META_SUFFIX


def entry_of(sidecar_path: str) -> str:
    """The entry path a sidecar file belongs to."""
    return sidecar_path.removesuffix(META_SUFFIX) + ENTRY_SUFFIX


def write_meta(store: Store, key: str, entry: dict[str, Any],
               modality: str | None = None) -> bool:
    """Keep E's `ec_transfer_params` entry for `key` (and the item's modality) beside the
    store entry, atomically (tmp, then rename); False when the store entry is gone or the
    write failed."""
    if not store.has_entry(key):
        return False  # E did not save it (store full?): a sidecar alone is useless
    doc: dict[str, Any] = {"key": key, "namespace": store.namespace, "entry": entry}
    if modality is not None:
        doc["modality"] = modality
    body = json.dumps(doc, separators=(",", ":")).encode()
    # `<name>.meta.<pid>.<n>`: the janitor reads the writer's pid from a tmp file's name.
    tmp = f"{store.tmp}/{key_filename(key)}.meta.{os.getpid()}.{TMP_TOKEN}{next(_tmp_ids)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     private.FILE_MODE)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.rename(tmp, meta_path(store, key))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True


def read_modality(sidecar_path: str, key: str) -> str | None:
    """The modality a sidecar names for `key`; None without one (or another key's)."""
    try:
        with open(sidecar_path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    modality = data.get("modality")
    return modality if isinstance(modality, str) else None


def read_meta(store: Store, key: str) -> dict[str, Any] | None:
    """E's entry for `key` with non-empty metadata, or None (absent, foreign or damaged)."""
    try:
        with open(meta_path(store, key), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key \
            or data.get("namespace") != store.namespace:
        return None
    entry = data.get("entry")
    if not isinstance(entry, dict) or not isinstance(entry.get("metadata"), dict) \
            or not entry["metadata"]:
        return None
    return entry
