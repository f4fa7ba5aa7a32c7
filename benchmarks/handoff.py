"""E->PD hand-off with unique images: what E's save (and PD's load) costs per image while the
store fills up, before and after the pool is stocked ahead, in one run.

    .venv/bin/python benchmarks/handoff.py [--images 48] [--gap-ms 20] [--block 8]

Every image is a new entry (a key never seen), so nothing is replaced or evicted: the store
is filling up, as in every request of a demo, a bench run or a fresh `up`. Two arms, each
in a namespace of its own, take turns in blocks of --block images (A B B A ...):
  before  a store without a capacity: every save writes a new tmpfs file (what a filling
          store paid before; the code path is unchanged for a store without a capacity)
  after   a store with the shipped capacity (8 GiB), as `up` plans it: E's stocker keeps
          the pool stocked with pre-faulted files, PD maps them ahead (cache/_prefault.py)
E is this process: per image it copies the embedding once into a buffer of its own (timed:
a memcpy of the same bytes, the yardstick on a busy machine), saves it with the connector's
save_tensor (timed), hands the key to PD, and waits --gap-ms (the next image's encode; a
sleep, as a GPU encoder leaves the CPU to the stocker). PD is a process of its own: it pins
the entry and loads it with read_tensor (timed), as the connector's worker does. Prints each
arm's save and load times (best, median, p90) with the memcpy's, how many saves claimed a
pooled file, and one key=value line: save_added_ms = median save before - after (the time
the change takes off each image), and each arm's median save and load over its memcpy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

import torch

from epdctl.cache import _recycle
from epdctl.cache.store import Pin, Store, unpin
from epdctl.connector._io import HostStaging, read_tensor, save_tensor

CAPACITY_BYTES = 8 << 30  # the shipped cache.capacity
ARMS = ("before", "after")


def pd(root: str, conn: Connection) -> None:
    """PD's worker: load each entry it is told of, answer the seconds it took."""
    stores = {arm: Store(root, arm) for arm in ARMS}
    stores["after"].watch_pool()  # what the connector's consumer does (start_worker_services)
    dst: torch.Tensor | None = None
    while (msg := conn.recv()) is not None:
        arm, key, rows = msg
        store = stores[arm]
        pin = store.pin(key, engine="pd", request=key, index=0, rows=rows)
        assert isinstance(pin, Pin), pin
        if dst is None or tuple(dst.shape) != pin.header.shape:
            dst = torch.empty(pin.header.shape, dtype=getattr(torch, pin.header.dtype))
        start = time.perf_counter()
        read_tensor(pin.paths[0], pin.header, dst)
        conn.send(time.perf_counter() - start)
        unpin(pin.paths)
    for store in stores.values():
        store.close()


def order(images: int, block: int) -> list[str]:
    """The arm of each hand-off: blocks taking turns A B B A A B ..."""
    turns: list[str] = []
    while len(turns) < 2 * images:
        pair = ARMS if (len(turns) // (2 * block)) % 2 == 0 else ARMS[::-1]
        for arm in pair:
            turns += [arm] * block
    return turns[: 2 * images]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48, help="per arm")
    parser.add_argument("--gap-ms", type=float, default=20.0,
                        help="between two images (E encoding the next one); 0: back to back")
    parser.add_argument("--block", type=int, default=8, help="images per turn")
    parser.add_argument("--rows", type=int, default=1280)
    parser.add_argument("--cols", type=int, default=3584)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory to work in")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="epdctl-handoff-", dir=args.dir)
    stores = {"before": Store(root, "before").create(),
              "after": Store(root, "after", capacity_bytes=CAPACITY_BYTES).create()}
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    reader = ctx.Process(target=pd, args=(root, there), daemon=True)
    reader.start()
    srcs = [torch.randn(args.rows, args.cols).to(torch.bfloat16) for _ in range(2)]
    staging = HostStaging(srcs[0].device)
    copy = torch.empty_like(srcs[0])
    saves: dict[str, list[float]] = {arm: [] for arm in ARMS}
    loads: dict[str, list[float]] = {arm: [] for arm in ARMS}
    copies: list[float] = []
    pooled = dict.fromkeys(ARMS, 0)
    try:
        for n, arm in enumerate(order(args.images, args.block)):
            store, key = stores[arm], f"img-{n}"
            spare = {os.stat(path).st_ino for path, _ in _recycle.pool_files(store.free)}
            start = time.perf_counter()
            copy.copy_(srcs[n % 2])
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            save_tensor(store, key, srcs[n % 2], staging)
            saves[arm].append(time.perf_counter() - start)
            pooled[arm] += os.stat(store.entry_path(key)).st_ino in spare
            here.send((arm, key, args.rows))
            loads[arm].append(here.recv())
            time.sleep(args.gap_ms / 1e3)
        here.send(None)
        reader.join(30)
    finally:
        for store in stores.values():
            store.close()
        if reader.is_alive():
            reader.kill()
        shutil.rmtree(root, ignore_errors=True)
    nbytes = srcs[0].numel() * srcs[0].element_size()
    print(f"{args.rows}x{args.cols} bfloat16 ({nbytes / 2**20:.0f} MiB), {args.images} unique "
          f"images per arm, {args.gap_ms:g} ms apart, turns of {args.block}")
    ms = {arm: {"save": [t * 1e3 for t in saves[arm]], "load": [t * 1e3 for t in loads[arm]]}
          for arm in ARMS}
    memcpy = [t * 1e3 for t in copies]
    print(f"memcpy: best {min(memcpy):.2f} ms p50 {statistics.median(memcpy):.2f} ms "
          f"p90 {pct(memcpy, 90):.2f} ms")
    for arm in ARMS:
        parts = [f"{k} best {min(v):.2f} ms p50 {statistics.median(v):.2f} ms p90 "
                 f"{pct(v, 90):.2f} ms" for k, v in ms[arm].items()]
        print(f"{arm:>6}: {', '.join(parts)}; {pooled[arm]}/{len(ms[arm]['save'])} saves into "
              "a pooled file")
    med = {(arm, k): statistics.median(ms[arm][k]) for arm in ARMS for k in ("save", "load")}
    base = statistics.median(memcpy)
    print(f"save_before_ms={med['before', 'save']:.2f} save_after_ms={med['after', 'save']:.2f} "
          f"save_added_ms={med['before', 'save'] - med['after', 'save']:.2f} "
          f"load_before_ms={med['before', 'load']:.2f} load_after_ms={med['after', 'load']:.2f} "
          f"memcpy_ms={base:.2f} "
          + " ".join(f"{k}_{arm}_vs_memcpy={med[arm, k] / base:.2f}"
                     for k in ("save", "load") for arm in ARMS)
          + f" pooled_after={pooled['after']}/{args.images}")

if __name__ == "__main__":
    main()
