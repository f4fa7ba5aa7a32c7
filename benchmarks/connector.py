"""EC data path: our tmpfs store vs ECExampleConnector's safetensors files vs a memcpy.

    .venv/bin/python benchmarks/connector.py [--reps 15] [--dir /dev/shm]

For each encoder-output size, times (best of --reps, the four taking turns, each from
caches holding none of its bytes: see best_of):
  ours     publish from a torch tensor + pin + read into a preallocated tensor + unpin
           (the connector's own functions), in steady state: the replaced entry's file is
           recycled, its pages and this process's mapping of it reused (as at capacity)
  fresh    the same into a new file every time (a store still filling up)
  example  safetensors save_file + load_file + copy into the preallocated tensor
           (what ECExampleConnector does, on the same tmpfs)
  memcpy   one copy of the same bytes into the preallocated tensor
Prints GB/s (tensor bytes / seconds) and ratios per size, then one key=value line with
the worst ratios over sizes: vs_memcpy = memcpy time / ours, vs_example = example / ours,
each with its spread (`_spread=LOW-HIGH`: the quartiles of the per-rep ratio at that size).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from epdctl.cache.janitor import clean
from epdctl.cache.store import Pin, Store, unpin
from epdctl.connector._io import HostStaging, dtype_name, read_tensor, save_tensor

SCRATCH_BYTES = 256 << 20  # well above the last-level cache of any one CPU
SIZES = ((1280, 3584, torch.bfloat16), (4096, 3584, torch.bfloat16), (16384, 2048, torch.float16))


def best_of(reps: int, fns: dict[str, Callable[[], None]],
            times: dict[str, list[float]] | None = None) -> dict[str, float]:
    """The best time of each, measured in turns in alternating order (A B C D, D C B A, ...:
    memory speed drifts on a shared host); `times` gets every rep's time.

    Before each timed call a scratch buffer larger than the CPU caches is rewritten, so
    every path starts with none of its bytes cached (as in serving, where an encoder
    output was made long before it is moved) and no path runs warm from the one before.
    """
    scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults, allocator growth
    best = dict.fromkeys(fns, float("inf"))
    for rep in range(reps):
        for name, fn in list(fns.items())[:: 1 if rep % 2 == 0 else -1]:
            scratch.fill_(rep)
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            best[name] = min(best[name], took)
            if times is not None:
                times.setdefault(name, []).append(took)
    return best


def spread(times: dict[str, list[float]], slow: str, fast: str) -> str:
    """LOW-HIGH: the quartiles of slow / fast over the reps (a rep's two paths ran side by
    side)."""
    ratios = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
    if len(ratios) < 4:
        return f"{min(ratios):.2f}-{max(ratios):.2f}"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{q1:.2f}-{q3:.2f}"


def ours(
    store: Store, src: torch.Tensor, dst: torch.Tensor, *, fresh: bool = False
) -> Callable[[], None]:
    shape = tuple(src.shape)
    keys = itertools.count()
    staging = HostStaging(src.device)

    def run() -> None:
        # fresh: a new key each time, so nothing is replaced and nothing can be recycled.
        key = f"bench-{next(keys)}" if fresh else "bench"
        save_tensor(store, key, src, staging)
        pin = store.pin(key, engine="bench", request="r", index=0, rows=shape[0])
        assert isinstance(pin, Pin), pin
        read_tensor(pin.paths[0], pin.header, dst)
        unpin(pin.paths)

    return run


def example(path: str, src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        save_file({"ec_cache": src.detach().cpu()}, path)
        dst.copy_(load_file(path)["ec_cache"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory to work in")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="epdctl-bench-", dir=args.dir)
    worst_memcpy = worst_example = worst_fresh = float("inf")
    spreads = {"vs_memcpy": "-", "vs_example": "-"}
    try:
        store = Store(root, "bench").create()
        fresh_store = Store(root, "bench-fresh").create()
        for rows, cols, dtype in SIZES:
            src = torch.randn(rows, cols).to(dtype)
            dst = torch.zeros_like(src)
            nbytes = src.numel() * src.element_size()
            rep_times: dict[str, list[float]] = {}
            best = best_of(
                args.reps,
                {
                    "memcpy": lambda: dst.copy_(src),  # noqa: B023
                    "ours": ours(store, src, dst),
                    # Its own namespace: no replaced entry ever feeds its pool.
                    "fresh": ours(fresh_store, src, dst, fresh=True),
                    "example": example(f"{root}/example.safetensors", src, dst),
                },
                rep_times,
            )
            assert torch.equal(dst, src)
            clean(root, all=True)
            t_memcpy, t_ours, t_fresh, t_example = (
                best[k] for k in ("memcpy", "ours", "fresh", "example")
            )
            r_memcpy, r_example = t_memcpy / t_ours, t_example / t_ours
            if r_memcpy < worst_memcpy:
                spreads["vs_memcpy"] = spread(rep_times, "memcpy", "ours")
            if r_example < worst_example:
                spreads["vs_example"] = spread(rep_times, "example", "ours")
            worst_memcpy, worst_example = min(worst_memcpy, r_memcpy), min(worst_example, r_example)
            worst_fresh = min(worst_fresh, t_memcpy / t_fresh)
            times = {"ours": t_ours, "fresh": t_fresh, "example": t_example, "memcpy": t_memcpy}
            rate = {k: nbytes / t / 1e9 for k, t in times.items()}
            print(
                f"{rows}x{cols} {dtype_name(dtype)} ({nbytes / 2**20:.0f} MiB): "
                f"ours {rate['ours']:.2f} GB/s, fresh {rate['fresh']:.2f} GB/s, "
                f"example {rate['example']:.2f} GB/s, "
                f"memcpy {rate['memcpy']:.2f} GB/s; vs_memcpy={r_memcpy:.2f} "
                f"vs_example={r_example:.2f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"vs_memcpy={worst_memcpy:.2f} vs_memcpy_spread={spreads['vs_memcpy']} "
        f"vs_example={worst_example:.2f} vs_example_spread={spreads['vs_example']} "
        f"fresh_vs_memcpy={worst_fresh:.2f}"
    )


if __name__ == "__main__":
    main()
