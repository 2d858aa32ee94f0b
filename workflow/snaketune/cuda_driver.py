"""The CUDA devices a launcher sees, asked of the CUDA driver (libcuda) directly instead of through torch.

The train, reference and dpo rules' own processes only count, name and size the GPUs before they start the
ranks; importing torch for that took 3.5 s of every GPU stage on the H200 (bench/RESULTS.md, "Where the start-up
goes"), and cuInit alone takes a fraction of it. The driver applies CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER
exactly as it does for torch, so the device at position i here is torch's cuda:i in the ranks. Without the driver
library (a CPU machine, a container without the NVIDIA runtime) or when cuInit fails, no device is seen, as
torch.cuda.is_available() would say; the reason is logged.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import cache

log = logging.getLogger("snaketune.gpus")

LIBRARY = "libcuda.so.1"
CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100


class DriverError(RuntimeError):
    pass


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    total_bytes: int


@cache
def _driver() -> ctypes.CDLL | None:
    """libcuda, initialized; None where there is no usable driver (the reason logged once)."""
    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError as e:
        log.debug("no CUDA driver library (%s): no CUDA devices", e)
        return None
    rc = lib.cuInit(0)
    if rc != CUDA_SUCCESS:
        if rc != CUDA_ERROR_NO_DEVICE:
            log.warning("cuInit failed with CUresult %d (%s): no CUDA devices", rc, _error_name(lib, rc))
        return None
    return lib


def _error_name(lib: ctypes.CDLL, rc: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
        return name.value.decode()
    return "unknown error"


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        raise DriverError(f"{what} failed with CUresult {rc} ({_error_name(lib, rc)})")


def device_count() -> int:
    """CUDA devices this process sees (0 without a driver)."""
    lib = _driver()
    if lib is None:
        return 0
    n = ctypes.c_int()
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    return n.value


def _handle(lib: ctypes.CDLL, ordinal: int) -> ctypes.c_int:
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    return dev


def device_info(ordinal: int) -> DeviceInfo:
    """Name and total memory of the device at `ordinal` (torch's cuda:<ordinal>)."""
    lib = _driver()
    if lib is None:
        raise DriverError(f"no CUDA driver: device {ordinal} does not exist")
    dev = _handle(lib, ordinal)
    name = ctypes.create_string_buffer(256)
    _check(lib, lib.cuDeviceGetName(name, len(name), dev), "cuDeviceGetName")
    total = ctypes.c_size_t()
    _check(lib, lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev), "cuDeviceTotalMem")
    return DeviceInfo(name.value.decode(errors="replace"), total.value)


def can_access_peer(a: int, b: int) -> bool:
    """Whether device `a` can read and write device `b`'s memory directly (torch.cuda.can_device_access_peer)."""
    lib = _driver()
    if lib is None:
        raise DriverError("no CUDA driver")
    can = ctypes.c_int()
    _check(
        lib,
        lib.cuDeviceCanAccessPeer(ctypes.byref(can), _handle(lib, a), _handle(lib, b)),
        "cuDeviceCanAccessPeer",
    )
    return bool(can.value)
