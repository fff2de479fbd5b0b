"""Whether Triton kernels can serve a call, and the per-stream scratch they share."""

from __future__ import annotations

import functools

import torch

from . import _env

_INTERPRET = _env.triton_flag("TRITON_INTERPRET")  # as Triton reads it: the kernels follow it


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    # (torch.compile takes the answer as a constant: tracing into a functools.cache wrapper makes it warn)
    return _import_triton()


@functools.cache
def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels through numpy (``TRITON_INTERPRET=1``), e.g. in CPU tests."""
    return _INTERPRET()


def can_launch(device: torch.device) -> bool:
    """A Triton kernel can run on ``device``: CUDA, or the CPU under the interpreter."""
    if not triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def fp8_tensor_cores(device: torch.device) -> bool:
    """The FP8 expert kernels run on E4M3 tensor cores: on CUDA devices (the backend admits sm_89+
    only). Elsewhere (the interpreter) they decode E4M3 bytes to fp32: the same products."""
    return device.type == "cuda"


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" alone means the current GPU now, which a cached answer must not outlive."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# Driver queries, answered once per device rather than on every eager call.
@functools.lru_cache(maxsize=64)
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=64)
def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def gpu_name(device: torch.device) -> str:
    """The CUDA device's name ("NVIDIA H200"), or "cpu"."""
    return _gpu_name(_indexed(device)) if device.type == "cuda" else "cpu"


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return _capability(_indexed(device))


def _hopper_or_later(device: torch.device) -> bool:
    return device.type == "cuda" and capability(device)[0] >= 9


def tma_copies(device: torch.device) -> bool:
    """Tensor descriptors (TMA bulk copies) work here: Hopper or later, or the interpreter (which
    emulates them)."""
    return interpreting() or _hopper_or_later(device)


def dependent_launches(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts before the previous one ends and waits for
    it in-kernel): Hopper or later; not in the interpreter, which runs no PTX."""
    return not interpreting() and _hopper_or_later(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter's stand-in)."""
    return _num_sms(_indexed(device)) if device.type == "cuda" else 4


@functools.lru_cache(maxsize=64)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


REGISTERS_PER_SM = 65536  # 32-bit registers of an SM's file (sm_80 to sm_90)
REGISTER_GRANULE = 8  # a thread's registers are allocated in multiples of this


def registers_for(programs_per_sm: int, num_warps: int) -> int:
    """Registers per thread at most for ``programs_per_sm`` programs of ``num_warps`` warps to fit one SM (168 for
    three programs of 4 warps): a kernel's ``maxnreg`` cap for that occupancy."""
    per_thread = REGISTERS_PER_SM // (programs_per_sm * num_warps * 32) // REGISTER_GRANULE * REGISTER_GRANULE
    if per_thread < 24:  # (ptxas's least)
        raise ValueError(f"{programs_per_sm} programs of {num_warps} warps do not fit one SM's registers")
    return min(255, per_thread)


_COUNTERS: dict[tuple, torch.Tensor] = {}
NUM_COUNTERS = 4096


def counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters for the 'last program finishes the job' kernels.

    One buffer per (device, stream): kernels on one stream run in order and each kernel resets
    the counters it used, so they are zero again at the next launch (also on CUDA-graph replay).
    """
    if device.type != "cuda":
        stream = 0
    elif device.index is not None:  # a tensor's device: the raw stream lookup (the stream object costs more)
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
