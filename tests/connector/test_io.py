"""Tensor <-> store copies of the connector (torch only, no vLLM); CUDA where there is one.

Runs without the suite's conftest too (`pytest --noconftest`), so a GPU machine with only
torch and pytest can run it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from epdctl.cache.store import Pin, Store, unpin
from epdctl.connector._io import HostStaging, load_tensors, read_tensor, save_tensor

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no GPU")]),
]


@pytest.fixture
def store() -> Iterator[Store]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="epdctl-test-io-", dir=base)
    yield Store(root, "io").create()
    shutil.rmtree(root, ignore_errors=True)


def pin(store: Store, key: str) -> Pin:
    p = store.pin(key, engine="e", request="r", index=0)
    assert isinstance(p, Pin), p
    return p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((7, 33), torch.bfloat16),
        ((64, 128), torch.float16),
        ((3, 5, 2), torch.float32),
        ((0, 16), torch.bfloat16),
    ],
)
def test_a_saved_tensor_loads_back_equal(
    store: Store, device: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    src = torch.randn(shape, device=device).to(dtype)
    staging = HostStaging(torch.device(device))
    assert save_tensor(store, "k", src, staging) == src.numel() * src.element_size()
    p = pin(store, "k")
    assert p.header.shape == shape and p.header.dtype == str(dtype).removeprefix("torch.")
    (out,) = load_tensors([(p.paths, p.header)], torch.device(device), staging)
    assert isinstance(out, torch.Tensor) and out.device.type == device
    assert out.dtype == dtype and torch.equal(out, src)
    unpin(p.paths)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_grad_tensors_are_saved_as_they_read(store: Store, device: str) -> None:
    base = torch.randn(40, 24, device=device, requires_grad=True)
    src = base.t()  # non-contiguous, needs grad
    save_tensor(store, "t", src, HostStaging(torch.device(device)))
    p = pin(store, "t")
    dst = torch.empty(p.header.shape, dtype=torch.float32)
    read_tensor(p.paths[0], p.header, dst)
    assert torch.equal(dst, src.detach().cpu())
    unpin(p.paths)


@pytest.mark.parametrize("device", DEVICES)
def test_one_staging_buffer_serves_step_after_step(store: Store, device: str) -> None:
    """The second step must not overwrite pinned staging the first step still copies from."""
    dev = torch.device(device)
    staging = HostStaging(dev)
    sources = {f"k{i}": torch.randn(256, 512, device=device).half() for i in range(6)}
    for key, t in sources.items():
        save_tensor(store, key, t, staging)
    pins = {key: pin(store, key) for key in sources}
    first = load_tensors(
        [(pins[k].paths, pins[k].header) for k in ("k0", "k1", "k2")], dev, staging
    )
    second = load_tensors(
        [(pins[k].paths, pins[k].header) for k in ("k3", "k4", "k5")], dev, staging
    )
    for key, out in zip(sources, first + second, strict=True):
        assert isinstance(out, torch.Tensor) and torch.equal(out, sources[key]), key
    for p in pins.values():
        unpin(p.paths)


def test_a_vanished_pin_is_an_error_in_place_of_its_tensor(store: Store) -> None:
    staging = HostStaging(torch.device("cpu"))
    for key in ("a", "b"):
        save_tensor(store, key, torch.ones(4, 8), staging)
    a, b = pin(store, "a"), pin(store, "b")
    unpin(a.paths)
    out = load_tensors([(a.paths, a.header), (b.paths, b.header)], torch.device("cpu"), staging)
    assert isinstance(out[0], OSError) and torch.equal(out[1], torch.ones(4, 8))
    unpin(b.paths)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_a_file_loaded_again_goes_straight_from_its_registered_mapping(store: Store) -> None:
    dev = torch.device("cuda")
    staging = HostStaging(dev)
    assert staging.registry is not None
    for round_ in range(4):
        # Same key, new content: the replaced file is recycled, so the same inodes (and
        # their kept, registered mappings) come back with new bytes in them.
        src = torch.randn(300, 1000, device="cuda").to(torch.bfloat16)
        save_tensor(store, "k", src, staging)
        p = pin(store, "k")
        (out,) = load_tensors([(p.paths, p.header)], dev, staging)
        unpin(p.paths)
        assert isinstance(out, torch.Tensor) and torch.equal(out, src), round_
    assert staging.registry.enabled and staging.registry._registered  # the DMA path ran


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_a_failed_registration_leaves_cuda_usable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import mmap

    from epdctl.connector._io import _clear_cuda_error

    path = tmp_path / "ro"
    path.write_bytes(b"x" * (1 << 20))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    ptr = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    rc = torch.cuda.cudart().cudaHostRegister(ptr, view.nbytes, 0)
    if int(rc) == 0:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        pytest.skip("this driver registers read-only mappings")
    _clear_cuda_error()
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # a launch check passes
    view.release()
    mm.close()
