"""Where a compiled kernel spills: inside a loop (costly every iteration) or only around it.

ptxas reports spill bytes for the whole kernel. A GEMM that saves a few addresses before its K loop
and reloads them for the epilogue costs nothing measurable, while one that spills its
accumulators inside the loop is slow; the tuner and the sm_90 compile check keep the first and
reject the second. The SASS comes from nvdisasm, which ships in Triton's NVIDIA backend.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*)")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?`?\(?(\.L_x_\d+)")
_LOCAL = re.compile(r"\b(LDL|STL)\b")


def nvdisasm() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return path if path.exists() else None


def ptxas_usage(ptx: str) -> tuple[dict, bytes]:
    """({"regs", "stack", "spill"}: registers, stack frame bytes, spill store + load bytes) as ptxas reports them for
    PTX assembled for sm_90a, and the cubin it made (for :func:`sass`). ptxas ships in Triton's NVIDIA backend."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        text = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(tmp) / "k.ptx"), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True).stderr
        cubin = (Path(tmp) / "k.cubin").read_bytes() if (Path(tmp) / "k.cubin").exists() else b""
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0  # noqa: E731
    return ({"regs": num(r"Used (\d+) registers"), "stack": num(r"(\d+) bytes stack frame"),
             "spill": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads")}, cubin)


def sass(cubin: bytes) -> str | None:
    """nvdisasm's listing of a cubin, or None where nvdisasm is missing or fails."""
    tool = nvdisasm()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else None


def local_memory_in_loops(listing: str) -> int:
    """Local-memory instructions (LDL/STL: register spills) inside any loop of a SASS listing; a loop
    is the span from a label to a later branch back to it."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in listing.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := _INSTRUCTION.match(line):
            instructions.append(m.group(1))
    in_loop = [False] * len(instructions)
    for i, text in enumerate(instructions):
        m = _BRANCH.search(text)
        if m and labels.get(m.group(1), i + 1) <= i:
            for j in range(labels[m.group(1)], i + 1):
                in_loop[j] = True
    return sum(1 for text, inside in zip(instructions, in_loop) if inside and _LOCAL.search(text))


def spills_in_loops(kernel) -> int | None:
    """LDL/STL instructions inside the loops of a compiled Triton kernel (None: cannot tell here)."""
    cubin = getattr(kernel, "asm", {}).get("cubin")
    listing = sass(cubin) if cubin else None
    return None if listing is None else local_memory_in_loops(listing)
