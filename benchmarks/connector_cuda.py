"""EC data path on a GPU: our store's host <-> GPU copies against the copy engine's limit.

    python benchmarks/connector_cuda.py [--reps 10] [--dir /dev/shm] [--device cuda]

Needs torch (with CUDA for the real thing), not vLLM. For each encoder-output size of
benchmarks/connector.py, best of --reps, in turns:
  limit       pinned host tensor -> GPU (what the copy engine can do)
  pageable    ordinary host tensor -> GPU
  load        the connector's load path (_io.load_tensors) in steady state: pin, DMA from
              the entry's kept mapping (registered with CUDA on its second load), unpin
  staged      the same through pinned staging: read the entry into it, copy to the GPU
  direct      the entry's mapping -> GPU in one pageable copy (no staging)
  registered  the entry's mapping, registered once with cudaHostRegister -> GPU
  save        the connector's save path (_io.save_tensor) in steady state: a DMA into the
              entry's kept mapping (registered on its second save)
  save_staged the same through pinned staging: GPU -> staging -> entry
  save_direct GPU -> the entry's mapping in one copy
Every loaded tensor is compared with the source. Prints GB/s per path and ends with one
key=value line: each path's GB/s over the limit's (worst over sizes).
`--device cpu` runs the same code without CUDA (a check of the script, not a benchmark).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

from epdctl.cache._maps import MAPPINGS
from epdctl.cache.store import Pin, Store, unpin
from epdctl.connector._io import HostStaging, load_tensors, mapped_tensor, save_tensor

SIZES = ((1280, 3584, torch.bfloat16), (4096, 3584, torch.bfloat16), (16384, 2048, torch.float16))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(
    reps: int, device: torch.device, fns: dict[str, Callable[[], None]],
    spread: dict[str, float] | None = None,
) -> dict[str, float]:
    """Best time of each path, the paths taking turns in alternating order (A B C, C B A,
    ...); a failing path reports nan. `spread`: each path's time p75 / p25 over the reps."""
    best = dict.fromkeys(fns, float("inf"))
    times: dict[str, list[float]] = {name: [] for name in fns}
    broken: set[str] = set()
    for rep in range(reps + 1):  # the first round is a warm-up
        order = list(fns.items()) if rep % 2 else list(fns.items())[::-1]
        for name, fn in order:
            if name in broken:
                continue
            sync(device)
            start = time.perf_counter()
            try:
                fn()
                sync(device)
            except Exception:
                traceback.print_exc()
                broken.add(name)
                continue
            if rep:
                times[name].append(time.perf_counter() - start)
                best[name] = min(best[name], times[name][-1])
    if spread is not None:
        for name, got in times.items():
            if len(got) >= 4 and name not in broken:
                q1, _, q3 = statistics.quantiles(got, n=4)
                spread[name] = q3 / q1
    return {k: float("nan") if k in broken else v for k, v in best.items()}


class Registered:
    """The pinned (cudaHostRegister) view of one entry's mapping, kept like the mapping."""

    def __init__(self, path: str, nbytes: int, offset: int) -> None:
        # A mapping of its own (the connector's registry registers the kept one; a range
        # cannot be registered twice), writable as the connector's is.
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, offset + nbytes)
        self.view = memoryview(self.mm)
        self.host = mapped_tensor(self.view[offset:], torch.uint8, (nbytes,))
        start = time.perf_counter()
        rc = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)
        self.ok = int(rc) == 0
        if not self.ok:
            print(f"cudaHostRegister failed: {rc}")
        self.register_s = time.perf_counter() - start

    def close(self) -> None:
        if self.ok:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        del self.host
        self.view.release()
        self.mm.close()
        os.close(self.fd)


def run_size(
    store: Store, rows: int, cols: int, dtype: torch.dtype, device: torch.device, reps: int,
    spread: dict[str, float] | None = None,
) -> dict[str, float]:
    gpu_src = torch.randn(rows, cols, device=device).to(dtype)
    nbytes = gpu_src.numel() * gpu_src.element_size()
    cuda = device.type == "cuda"
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned.copy_(gpu_src.reshape(-1).view(torch.uint8))
    pageable = pinned.clone()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    staging = HostStaging(device)
    staged_only = HostStaging(device, register=False)
    # A namespace per save path: each recycles its own files (a file registered by one
    # path must not speed up another).
    saves = {
        name: Store(store.root.parent, f"{store.namespace}-{name}-{rows}").create()
        for name in ("save", "staged", "direct")
    }
    key = f"cuda-{rows}x{cols}"
    save_tensor(store, key, gpu_src, staging)
    pin = store.pin(key, engine="bench", request="r", index=0, rows=rows)
    assert isinstance(pin, Pin), pin
    fd = os.open(pin.paths[0], os.O_RDONLY)
    end = pin.header.data_offset + nbytes

    def loader(name: str, host: HostStaging) -> Callable[[], None]:
        def load() -> None:
            p = store.pin(key, engine="bench", request="l", index=0, rows=rows)
            assert isinstance(p, Pin), p
            (t,) = load_tensors([(p.paths, p.header)], device, host)
            assert isinstance(t, torch.Tensor), t
            sync(device)
            unpin(p.paths)
            loaded[name] = t

        return load

    def direct() -> None:
        with MAPPINGS.view(fd, end, write=False) as mv:
            host = mapped_tensor(mv[pin.header.data_offset :], torch.uint8, (nbytes,))
            dst.copy_(host)  # pageable: synchronous
            del host

    loaded: dict[str, torch.Tensor] = {}
    fns: dict[str, Callable[[], None]] = {
        "limit": lambda: dst.copy_(pinned, non_blocking=True),
        "pageable": lambda: dst.copy_(pageable),
        "load": loader("load", staging),
        "staged": loader("staged", staged_only),
        "direct": direct,
        "save": lambda: save_tensor(saves["save"], key, gpu_src, staging) and None,
        "save_staged": lambda: save_tensor(saves["staged"], key, gpu_src, staged_only) and None,
    }
    registered = Registered(pin.paths[0], nbytes, pin.header.data_offset) if cuda else None
    if registered is not None and registered.ok:
        fns["registered"] = lambda: dst.copy_(registered.host, non_blocking=True)

    def save_direct() -> None:
        def fill(mapped: memoryview) -> None:
            mapped_tensor(mapped, gpu_src.dtype, tuple(gpu_src.shape)).copy_(gpu_src)

        saves["direct"].publish(key, fill, dtype=str(gpu_src.dtype)[6:], shape=tuple(gpu_src.shape))

    fns["save_direct"] = save_direct
    try:
        best = best_of(reps, device, fns, spread)
        want = gpu_src.reshape(-1).view(torch.uint8)
        for name in ("load", "staged"):
            got = loaded[name].reshape(-1).view(torch.uint8)
            assert torch.equal(got, want), f"{name} differs"
        if staging.registry is not None:
            print(f"  registered mappings: {len(staging.registry._registered)}")
        direct()
        sync(device)
        assert torch.equal(dst, want), "direct differs"
        if "registered" in fns:
            fns["registered"]()
            sync(device)
            assert torch.equal(dst, want), "registered differs"
            best["register_once"] = registered.register_s if registered else float("nan")
    finally:
        if registered is not None:
            registered.close()
        os.close(fd)
        unpin(pin.paths)
    best["nbytes"] = nbytes
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory to work in")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --device cpu to check the script only")
        print(
            torch.cuda.get_device_name(device),
            "torch",
            torch.__version__,
            "threads",
            torch.get_num_threads(),
        )
    root = tempfile.mkdtemp(prefix="epdctl-bench-cuda-", dir=args.dir)
    worst: dict[str, float] = {}
    spreads: dict[str, float] = {}
    try:
        store = Store(root, "bench").create()
        for rows, cols, dtype in SIZES:
            spread: dict[str, float] = {}
            best = run_size(store, rows, cols, dtype, device, args.reps, spread)
            for k, v in spread.items():
                spreads[k] = max(spreads.get(k, 1.0), v)
            nbytes = best.pop("nbytes")
            register_s = best.pop("register_once", float("nan"))
            rates = {k: nbytes / t / 1e9 for k, t in best.items()}
            print(
                f"{rows}x{cols} {str(dtype)[6:]} ({nbytes / 2**20:.0f} MiB): "
                + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items())
                + f"; cudaHostRegister once {register_s * 1e3:.2f} ms"
            )
            for k in (
                "load",
                "staged",
                "direct",
                "registered",
                "save",
                "save_staged",
                "save_direct",
            ):
                if k in rates:
                    ratio = rates[k] / rates["limit"]
                    worst[k] = min(worst.get(k, float("inf")), ratio)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # The spread: each path's p75 / p25 time over the reps (the largest over sizes).
    print(" ".join(f"{k}_vs_limit={v:.2f} {k}_spread={spreads.get(k, float('nan')):.2f}"
                   for k, v in worst.items()))


if __name__ == "__main__":
    main()
