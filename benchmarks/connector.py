"""EC data path: our tmpfs store vs ECExampleConnector's safetensors files vs a memcpy.

    .venv/bin/python benchmarks/connector.py [--reps 7] [--dir /dev/shm]

For each encoder-output size, times (best of --reps):
  ours     publish from a torch tensor + pin + read into a preallocated tensor + unpin,
           in steady state: the replaced entry's tmpfs pages are recycled (as at capacity)
  fresh    the same on new tmpfs pages every time (a store still filling up)
  example  safetensors save_file + load_file + copy into the preallocated tensor
           (what ECExampleConnector does, on the same tmpfs)
  memcpy   one copy of the same bytes into the preallocated tensor
Prints GB/s (tensor bytes / seconds) and ratios per size, then one key=value line with
the worst ratios over sizes: vs_memcpy = memcpy time / ours, vs_example = example / ours.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from epdctl.cache.janitor import clean
from epdctl.cache.store import Pin, Store, read_into, unpin
from epdctl.connector._io import as_bytes, dtype_name

SIZES = ((1280, 3584, torch.bfloat16), (4096, 3584, torch.bfloat16), (16384, 2048, torch.float16))


def best_of(reps: int, fn: Callable[[], None]) -> float:
    fn()  # warm-up: first-touch page faults, allocator growth
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def ours(
    store: Store, src: torch.Tensor, dst: torch.Tensor, *, fresh: bool = False
) -> Callable[[], None]:
    shape = tuple(src.shape)
    keys = itertools.count()

    def run() -> None:
        # fresh: a new key each time, so nothing is replaced and nothing can be recycled.
        key = f"bench-{next(keys)}" if fresh else "bench"
        store.publish(key, as_bytes(src), dtype=dtype_name(src.dtype), shape=shape)
        pin = store.pin(key, engine="bench", request="r", index=0, rows=shape[0])
        assert isinstance(pin, Pin), pin
        read_into(pin.paths[0], pin.header, as_bytes(dst))
        unpin(pin.paths)

    return run


def example(path: str, src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        save_file({"ec_cache": src.detach().cpu()}, path)
        dst.copy_(load_file(path)["ec_cache"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory to work in")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="epdctl-bench-", dir=args.dir)
    worst_memcpy = worst_example = worst_fresh = float("inf")
    try:
        store = Store(root, "bench").create()
        for rows, cols, dtype in SIZES:
            src = torch.randn(rows, cols).to(dtype)
            dst = torch.zeros_like(src)
            nbytes = src.numel() * src.element_size()
            t_memcpy = best_of(args.reps, lambda: dst.copy_(src))  # noqa: B023
            t_fresh = best_of(args.reps, ours(store, src, dst, fresh=True))
            clean(root, all=True)
            t_ours = best_of(args.reps, ours(store, src, dst))
            assert torch.equal(dst, src)
            dst.zero_()
            t_example = best_of(args.reps, example(f"{root}/example.safetensors", src, dst))
            assert torch.equal(dst, src)
            r_memcpy, r_example = t_memcpy / t_ours, t_example / t_ours
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
        f"vs_memcpy={worst_memcpy:.2f} vs_example={worst_example:.2f} "
        f"fresh_vs_memcpy={worst_fresh:.2f}"
    )


if __name__ == "__main__":
    main()
