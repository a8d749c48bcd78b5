"""The compute-dtype switches every layer reads: the names a config or enable() takes
(`parse_amp_dtype`, `amp_name`), autocast on or off from them (`autocast`), what autocast computes
in right now (`autocast_dtype`), and the dtype a device can compute in natively (`native_amp_dtype`:
bf16 becomes fp16 below compute capability 8.0). The loss scaler is amp.py.
"""

from typing import Optional, Tuple

import torch

_AMP_DTYPES = {
    None: None, "none": None, "fp32": None, "float32": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def parse_amp_dtype(value) -> Optional[torch.dtype]:
    """'bf16' / 'fp16' / 'fp32' / None / a torch dtype -> torch dtype or None (full precision)."""
    if isinstance(value, torch.dtype):
        if value == torch.float32:
            return None
        if value in (torch.bfloat16, torch.float16):
            return value
    elif value is None or isinstance(value, str):
        key = value.lower() if isinstance(value, str) else value
        if key in _AMP_DTYPES:
            return _AMP_DTYPES[key]
    raise ValueError(f"amp_dtype must be one of None, 'fp32', 'bf16', 'fp16' (or a torch dtype), got {value!r}")


def amp_name(amp_dtype: Optional[torch.dtype]) -> str:
    """The name parse_amp_dtype reads back: fp32 (no autocast), bf16 or fp16."""
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]


def compute_name(amp_dtype: Optional[torch.dtype], weights_dtype: torch.dtype) -> str:
    """What an episode computes in, for a line: the autocast's dtype, else the weights' own (fp64
    for a float64 model, which "fp32", the option's name for no autocast, would misstate)."""
    if amp_dtype is not None:
        return amp_name(amp_dtype)
    return {torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weights_dtype, "fp32")


def autocast(device_type: str, amp_dtype: Optional[torch.dtype]):
    """Autocast to `amp_dtype` (a torch dtype from parse_amp_dtype), or off when it is None."""
    return torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)


def refuse_fp16_on_cpu(amp_dtype: Optional[torch.dtype], device, asked_by: str, instead: str) -> None:
    """The one rule for fp16 off a GPU, enable()'s and the trainer's: refused. fp16 autocast on the
    CPU is a GPU setting run where no GPU is: slower than fp32, and the CPU's half precision is
    bf16. `asked_by` names the setting that asked, `instead` the settings that work."""
    if amp_dtype == torch.float16 and torch.device(device).type == "cpu":
        raise ValueError(f"fp16 on the CPU ({asked_by}) is a GPU setting, slower than fp32 there; use {instead}")


def native_amp_dtype(amp_dtype: Optional[torch.dtype], device) -> Tuple[Optional[torch.dtype], str]:
    """(the dtype to compute in on `device`, a one-line note when it is not `amp_dtype`).

    Below compute capability 8.0 a GPU has no bf16 arithmetic: torch.cuda.is_bf16_supported()
    still says True (emulation), but bf16 convolutions leave cuDNN and run slower than fp32.
    There bf16 becomes fp16, which needs the loss scaler."""
    device = torch.device(device)
    if amp_dtype != torch.bfloat16 or device.type != "cuda":
        return amp_dtype, ""
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return amp_dtype, ""
    return torch.float16, (
        f"bf16 was asked for, but {torch.cuda.get_device_name(device)} (compute capability "
        f"{major}.{minor}, below 8.0) only emulates bf16: using fp16 with the loss scaler instead")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast computes in on `device_type` right now; None when autocast is off or
    the device has none (meta)."""
    # cpu and cuda always have autocast; asking costs a call torch.compile cannot trace on CUDA
    available = device_type in ("cpu", "cuda") or torch.amp.is_autocast_available(device_type)
    if available and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def gpu_prefers_nhwc(capability: Tuple[int, int], name: str, amp_dtype: Optional[torch.dtype], tf32: bool) -> bool:
    """Whether cuDNN's convolutions in `amp_dtype` (None or float32: fp32) run faster NHWC on a GPU
    of this compute capability and name: where they run on Tensor Cores, whose preferred layout
    cuDNN documents as NHWC (fp16 from Volta, 7.0; bf16 and fp32 as TF32 from Ampere, 8.0, when
    torch.backends.cudnn.allow_tf32). Measured faster on Hopper in fp32 (TF32), bf16 and fp16;
    inferred elsewhere (docs/benchmarks.md, "channels_last on a GPU"). No Tensor Cores (below 7.0,
    Turing's GTX 16 series), fp32 without TF32, or fp64 (never TF32, never measured): NCHW, where
    cuDNN documents no gain."""
    if capability[0] < 7 or "GTX 16" in name or amp_dtype == torch.float64:
        return False
    if amp_dtype == torch.float16:
        return True
    return capability[0] >= 8 and (amp_dtype == torch.bfloat16 or tf32)


def nhwc_faster(device, amp_dtype: Optional[torch.dtype]) -> bool:
    """gpu_prefers_nhwc for a CUDA `device`; False off CUDA (the CPU's rule is the caller's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return gpu_prefers_nhwc(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device), amp_dtype,
                            torch.backends.cudnn.allow_tf32)
