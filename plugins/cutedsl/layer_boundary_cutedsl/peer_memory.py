"""Peer-mapped device memory for the one-shot all-reduce: CUDA IPC through the driver API.

Each rank allocates one buffer with `cuMemAlloc` (outside torch's caching allocator, so that
releasing it gives the memory back at once), exports it with `cuIpcGetMemHandle`, and maps every
peer's buffer with `cuIpcOpenMemHandle`. The same code serves both worlds the plugin runs in:

- one GPU per rank (an NCCL world): the mapping reaches the peer GPU over NVLink / PCIe P2P
  (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`);
- several ranks sharing one GPU (a gloo world, each process `torch.cuda.set_device(0)`): the
  mapping is a second virtual address of the same device memory in another process.

It is the mechanism FlashInfer's `trtllm` workspace uses (cudaIpc*, the runtime's wrappers of
these calls), and it works in both worlds. It needs no process-group backend
feature (the 64-byte handles travel through `Collectives.all_gather` as int64 words) and no
particular torch version. The driver is reached through ctypes (`libcuda.so.1`), whose C ABI is
stable, rather than a Python binding whose struct wrappers change between releases.

The device code never touches this module; it gets the addresses.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Callable, Optional

__all__ = ["PeerMemory", "CudaIpcMemory", "HostWords", "CudaError", "HANDLE_BYTES"]

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


class CudaError(RuntimeError):
    pass


class HostWords:
    """int64 words in host memory that a kernel can write (a timed-out CTA's report)."""

    def __init__(self, count: int, device_address: int, read: Callable[[], list], free: Callable[[], None]):
        self.count = count
        self.device_address = device_address
        self._read = read
        self._free = free

    def read(self) -> list:
        return self._read()

    def free(self) -> None:
        if self._free is not None:
            self._free()
            self._free = None


class PeerMemory:
    """What the workspace needs from a memory backend (every method is local to this rank)."""

    name = "abstract"

    def allocate(self, nbytes: int, device) -> int:
        """A zero-filled buffer of `nbytes` on `device`, the zeros complete; its address."""
        raise NotImplementedError

    def export(self, address: int) -> bytes:
        """A handle (at most HANDLE_BYTES bytes) another process can open."""
        raise NotImplementedError

    def open(self, handle: bytes, device) -> int:
        """Map a peer's buffer; its address in this process."""
        raise NotImplementedError

    def close(self, address: int, device) -> None:
        """Unmap a peer's buffer opened with `open`."""
        raise NotImplementedError

    def free(self, address: int, device) -> None:
        raise NotImplementedError

    def host_words(self, count: int, device) -> HostWords:
        """`count` zeroed int64 words of host memory a kernel on `device` can write."""
        raise NotImplementedError

    def free_bytes(self, device) -> Optional[int]:
        """Free device memory as the driver reports it (None when unknown)."""
        return None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02

_P = ctypes.POINTER
_u64 = ctypes.c_uint64
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuCtxGetCurrent": [_P(ctypes.c_void_p)],
    "cuCtxGetDevice": [_P(ctypes.c_int)],
    "cuMemAlloc_v2": [_P(_u64), ctypes.c_size_t],
    "cuMemFree_v2": [_u64],
    "cuMemsetD8_v2": [_u64, ctypes.c_ubyte, ctypes.c_size_t],
    "cuIpcGetMemHandle": [_P(_IpcHandle), _u64],
    "cuIpcOpenMemHandle_v2": [_P(_u64), _IpcHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_u64],
    "cuMemHostAlloc": [_P(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostGetDevicePointer_v2": [_P(_u64), ctypes.c_void_p, ctypes.c_uint],
    "cuMemFreeHost": [ctypes.c_void_p],
    "cuMemGetInfo_v2": [_P(ctypes.c_size_t), _P(ctypes.c_size_t)],
    "cuGetErrorName": [ctypes.c_int, _P(ctypes.c_char_p)],
}

#: older names with the same C signature, tried when a symbol is missing
_FALLBACKS = {"cuIpcOpenMemHandle_v2": ("cuIpcOpenMemHandle",)}

_driver_lock = threading.Lock()
_driver = None


def _load_driver():
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name, argtypes in _SIGNATURES.items():
                fn = None
                for symbol in (name, *_FALLBACKS.get(name, ())):
                    fn = getattr(lib, symbol, None)
                    if fn is not None:
                        break
                if fn is None:
                    raise CudaError(f"libcuda.so.1 exports no {name}")
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
                setattr(lib, name, fn)
            _driver = lib
    return _driver


class CudaIpcMemory(PeerMemory):
    """cuMemAlloc + CUDA IPC handles, in torch's current context for the device.

    `driver` replaces libcuda (tests pass an object with the same function names)."""

    name = "cuda-ipc"

    def __init__(self, driver=None):
        self._lib = driver

    @property
    def lib(self):
        if self._lib is None:
            self._lib = _load_driver()
        return self._lib

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            try:
                self.lib.cuGetErrorName(result, ctypes.byref(name))
                label = (name.value or b"").decode() or str(result)
            except Exception:  # noqa: BLE001 - the code is still reported
                label = str(result)
            raise CudaError(f"{what} failed: {label} ({result})")

    @contextlib.contextmanager
    def _context(self, device):
        """torch's (primary) context of `device`, current on this thread for the driver calls."""
        import torch

        device = torch.device(device)
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # initialises the context and makes it current
            ctx = ctypes.c_void_p()
            self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                raise CudaError("no CUDA context is current after torch initialised the device")
            ordinal = ctypes.c_int(-1)
            self._check(self.lib.cuCtxGetDevice(ctypes.byref(ordinal)), "cuCtxGetDevice")
            if device.index is not None and ordinal.value != device.index:
                raise CudaError(f"the current CUDA context is on device {ordinal.value}, not {device.index}")
            yield

    def allocate(self, nbytes: int, device) -> int:
        import torch

        ptr = _u64(0)
        with self._context(device):
            self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc({nbytes})")
            try:
                self._check(self.lib.cuMemsetD8_v2(ptr.value, 0, nbytes), "cuMemsetD8")
                torch.cuda.synchronize(device)  # the zeros are in memory before any peer can see the buffer
            except BaseException:
                self.lib.cuMemFree_v2(ptr.value)
                raise
        return int(ptr.value)

    def export(self, address: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), address), "cuIpcGetMemHandle")
        return bytes(ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES))

    def open(self, handle: bytes, device) -> int:
        if len(handle) != HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, HANDLE_BYTES)
        ptr = _u64(0)
        with self._context(device):
            self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, address: int, device) -> None:
        with self._context(device):
            self._check(self.lib.cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle")

    def free(self, address: int, device) -> None:
        with self._context(device):
            self._check(self.lib.cuMemFree_v2(address), "cuMemFree")

    def host_words(self, count: int, device) -> HostWords:
        nbytes = 8 * count
        host = ctypes.c_void_p()
        dev = _u64(0)
        with self._context(device):
            flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP
            self._check(self.lib.cuMemHostAlloc(ctypes.byref(host), nbytes, flags), "cuMemHostAlloc")
            ctypes.memset(host.value, 0, nbytes)
            try:
                self._check(self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host.value, 0), "cuMemHostGetDevicePointer")
            except BaseException:
                self.lib.cuMemFreeHost(host.value)
                raise
        words = (ctypes.c_int64 * count).from_address(host.value)
        lib = self.lib

        def read() -> list:
            return list(words)  # plain host memory: readable even after a kernel trapped

        def free() -> None:
            lib.cuMemFreeHost(host.value)

        return HostWords(count, int(dev.value), read, free)

    def free_bytes(self, device) -> Optional[int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        with self._context(device):
            self._check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return int(free.value)
