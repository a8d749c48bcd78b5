"""The CUDA emulator from Python: builds (build.py) and loads the library, passes torch CPU
tensors to the driver's entry points (driver.cpp), and returns each call's status with the
emulator's reports. `run(...)` calls one entry point on the C kernels or on the emulated CUDA
launchers; tests compare the two."""

import ctypes
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .build import build

C, CUDA = 0, 1
QCA_DTYPE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
             torch.complex64: 0, torch.complex128: 1}
ORDERS = {"forward": 0, "reverse": 1, "random": 2}
DEFAULTS = {"sms": 132, "shared_optin": 64 * 1024, "order": "forward", "seed": 0}

i64, i32, f64, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p


class EmuTensor(ctypes.Structure):  # driver.cpp's emu_tensor
    _fields_ = [("data", ptr), ("dtype", i64), ("sizes", i64 * 4), ("strides", i64 * 4)]


T = ctypes.POINTER(EmuTensor)
ERR = ctypes.POINTER(ctypes.c_int)
SIGNATURES = {
    "emu_qca_pack": [i32, T, T, ERR],
    "emu_qca_pack_backward": [i32, T, T, ERR],
    "emu_qca_update": [i32, T, T, f64, i32, f64, ptr, ERR],
    "emu_qca_update_backward": [i32, T, T, T, f64, i32, f64, ptr, ptr, ERR],
    "emu_noise": [i32, i32, T, f64, ctypes.c_uint64, ctypes.c_uint64, i32, ptr, ERR],
    "emu_gn_forward": [i32, T, i64, i32, f64, T, T, i32, T, T, ptr, ptr, i64, ERR],
    "emu_gn_backward": [i32, T, T, i64, i32, T, T, T, T, ptr, ptr, ptr, ptr, i64, ERR],
    "emu_unscale": [i32, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ERR],
    "emu_scale_update": [i32, ptr, ptr, ptr, f64, f64, i64, ERR],
    "emu_accumulate": [i32, i64, ptr, ptr, ptr, ptr, ptr, ERR],
    "emu_step_difference": [i32, i64, i32, i64, ptr, ptr, ptr, ptr, ERR],
    "emu_max_pool": [i32, i64, ptr, i32, ptr, ptr, ERR],
    "emu_max_pool_backward": [i32, i64, ptr, i32, ptr, ptr, ptr, i32, ERR],
}


def describe(t, dtype=None):
    """An emu_tensor for `t` (up to 4 dimensions); `dtype` overrides its qca_dtype code."""
    sizes = list(t.shape) + [1] * (4 - t.dim())
    strides = list(t.stride()) + [0] * (4 - t.dim())
    code = QCA_DTYPE[t.dtype] if dtype is None else dtype
    return ctypes.byref(EmuTensor(t.data_ptr(), code, (i64 * 4)(*sizes), (i64 * 4)(*strides)))


@dataclass
class Result:
    status: int
    cuda_error: int
    reports: list

    def check(self):
        """Raises unless the call returned QCA_OK without a single report."""
        assert self.status == 0 and not self.reports, (
            f"status {self.status}, CUDA error {self.cuda_error}, emulator reports:\n"
            + "\n".join(self.reports))
        return self


class Emulator:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name, None)
            if fn is not None:  # a library built from a subset of the kernels lacks some
                fn.argtypes, fn.restype = argtypes, i32
        self.lib.emu_gn_workspace_bytes.argtypes = [T, i64, i32, i64, i32]
        self.lib.emu_gn_workspace_bytes.restype = i64
        self.lib.emu_unscale_workspace_size.argtypes = [i64, ptr]
        self.lib.emu_unscale_workspace_size.restype = i64
        self.lib.qca_emu_configure.argtypes = [i32, i32, i32, ctypes.c_uint64]
        self.lib.qca_emu_report.restype = ctypes.c_char_p
        self.lib.qca_emu_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        self.configure()

    def configure(self, **settings):
        s = {**DEFAULTS, **settings}
        self.lib.qca_emu_configure(s["sms"], s["shared_optin"], ORDERS[s["order"]], s["seed"])

    @contextmanager
    def settings(self, **settings):
        self.configure(**settings)
        try:
            yield self
        finally:
            self.configure()

    def reports(self):
        return [self.lib.qca_emu_report(i).decode() for i in range(self.lib.qca_emu_report_count())]

    def counters(self):
        out = (ctypes.c_uint64 * 4)()
        self.lib.qca_emu_counters(out)
        return dict(zip(("launches", "blocks", "threads", "switches"), out))

    def run(self, name, backend, *args):
        """Calls driver entry point `name` on `backend` (C or CUDA)."""
        self.lib.qca_emu_clear_reports()
        error = ctypes.c_int(0)
        status = getattr(self.lib, name)(backend, *args, ctypes.byref(error))
        return Result(status, error.value, self.reports())


@functools.lru_cache(maxsize=None)
def emulator(cuda_sources=None):
    """The emulator built from `cuda_sources` (a tuple of paths; default every kernel file)."""
    return Emulator(build(cuda_sources))
