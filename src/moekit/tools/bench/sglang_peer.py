"""The Triton ``fused_moe_kernel`` of SGLang (adapted from vLLM's, which vLLM's Triton MoE path runs) as a peer of
`moekit bench`, loaded at bench time from an installed ``sglang`` package. Nothing of SGLang is copied here.

Install it without its dependencies (they pin another torch and take gigabytes)::

    pip install --no-deps sglang apache-tvm-ffi

Why not ``import sglang``: the package's ``__init__`` and the module-level imports of the files the peer
needs execute about 300 of SGLang's modules (sglang 0.5.23, counted on a CPU machine with absent packages
replaced by empty ones) and need packages a bench machine rarely has: ``sgl_kernel`` (a 373 MB wheel built
for torch 2.14.1, imported at module level by ``triton_utils/fused_moe.py``, which the ``triton_utils``
package imports), ``tvm_ffi``, ``msgspec``, ``orjson``, ``pybase64``, ``starlette``, ``pyzmq`` and ``dill``.
So this module reads each file from the installed package and executes only the top-level definitions the
bf16 call needs, in a namespace of its own (no entry in ``sys.modules``, nothing stubbed there). The names
those definitions take from the rest of SGLang are bound to what a CUDA server without expert parallelism,
LoRA or deterministic mode runs with (:func:`_bindings`). Files and definitions used:

- ``sglang/kernels/ops/moe/fused_moe_triton_kernels.py``: ``fused_moe_kernel`` and its host launcher
  ``invoke_fused_moe_kernel`` (both GEMMs), ``act_and_mul_triton`` (SiLU and multiply) and
  ``moe_sum_reduce_triton`` (the sum over a token's k slots).
- ``sglang/srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py``: the engine's
  ``moe_align_block_size``, which picks ``moe_align_small_numel`` (Triton, from
  ``sglang/kernels/ops/moe/moe_align_small_numel.py``) for at most 64 pairs and more than 63 experts,
  and the CUDA kernel otherwise. That CUDA kernel comes from ``sgl_kernel`` when it imports, else it is
  built once from the wheel's own ``sglang/kernels/jit/csrc/moe/moe_align_kernel.cu`` with
  apache-tvm-ffi and nvcc, as SGLang's JIT backend of the same op builds it.
- ``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py``: the engine's config lookup
  (``get_moe_configs``: its tuned file for (E, N, device name) under the running Triton version, then
  under other Triton versions; ``get_default_config`` where there is none) and ``get_config_dtype_str``.
- ``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py``: ``swiglu_gpt_oss_sigmoid_alpha``, the
  engine's gpt-oss activation (torch.compile'd).

The call follows the engine's ``_fused_moe_kernel_sequence`` for bf16 weights without expert parallelism:
align, GEMM1 into [T*k, 2I], the activation, GEMM2 with the router weight into [T, k, H], the sum over k
(k = 2: ``torch.add``, as the engine). Where the engine calls a CUDA kernel of ``sgl_kernel`` that cannot
be loaded here, the peer runs the engine's own Triton kernel for the same step and says so in the
results: SiLU-and-multiply is always ``act_and_mul_triton`` (the engine: its CUDA ``silu_and_mul``), and
the sum over k above 32 tokens is ``moe_sum_reduce_triton`` unless ``sgl_kernel`` imports (the engine
uses that Triton kernel up to 32 tokens on Hopper, and ``sgl_kernel.moe_sum_reduce`` above).

Layouts: the engine's w1 is [E, 2I, H] with [gate; up] rows for SiLU models and interleaved
(gate, up) rows for gpt-oss (``gate_up_interleaved``), its w2 [E, H, I], its biases [E, 2I] and [E, H]:
moekit's layouts, so the peer reads moekit's weights as they are (no conversion).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import types
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F

INSTALL = "pip install --no-deps sglang apache-tvm-ffi"
WRITTEN_FOR = "0.5.23"  # the release whose files this module reads; another one may have moved a definition

KERNELS = "kernels/ops/moe/fused_moe_triton_kernels.py"
SMALL_ALIGN = "kernels/ops/moe/moe_align_small_numel.py"
ALIGN = "srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py"
CONFIG = "srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"
RUNNER = "srt/layers/moe/moe_runner/triton_utils/fused_moe.py"
ALIGN_CU = "kernels/jit/csrc/moe/moe_align_kernel.cu"
JIT_INCLUDE = "kernels/jit/include"

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # gpt-oss's swiglu (moekit's swiglu_oai)


class LoadError(RuntimeError):
    """The installed sglang lacks a file or definition this peer reads."""


def package_dir() -> Path | None:
    """The installed ``sglang`` package's folder, found without importing it; None if not installed."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing() -> str | None:
    """None if the peer can be loaded here, else one line saying why and how to install it."""
    root = package_dir()
    if root is None:
        return f"sglang is not installed ({INSTALL})"
    absent = [f for f in (KERNELS, SMALL_ALIGN, ALIGN, CONFIG, RUNNER) if not (root / f).is_file()]
    if absent:
        return (f"sglang {version() or '?'} at {root} has no {', '.join(absent)} (this peer reads sglang "
                f"{WRITTEN_FOR}'s files: {INSTALL.replace('sglang', f'sglang=={WRITTEN_FOR}', 1)})")
    return None


def definitions(path: Path, names: list[str], bindings: dict) -> types.SimpleNamespace:
    """Execute the top-level definitions ``names`` of the file ``path`` (functions, classes, assignments,
    in file order) in a fresh namespace holding ``bindings``. Line numbers and the file name are the
    file's own, so ``inspect.getsource`` (which ``triton.jit`` reads) finds the source. A name the file
    does not define raises :class:`LoadError`."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError) as exc:
        raise LoadError(f"cannot read {path}: {exc}") from exc
    body, found = [], set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            body.append(node)  # the file's annotations stay unevaluated strings, as in the file
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            targets = {node.name}
        elif isinstance(node, ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = {node.target.id}
        else:
            continue
        if targets & set(names):
            body.append(node)
            found |= targets
    absent = [n for n in names if n not in found]
    if absent:
        raise LoadError(f"{path} defines no {', '.join(absent)} (this peer reads sglang {WRITTEN_FOR}'s files)")
    namespace = {"__name__": f"moekit_sglang_peer.{path.stem}", "__file__": str(path), "__builtins__": builtins,
                 **bindings}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return types.SimpleNamespace(**{n: namespace[n] for n in names})


class _Messages(logging.Handler):
    """The config lookup's log lines: they name the tuned file it read, or say it used the default."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _pdl() -> bool:
    # sglang.kernels.jit.utils.arch.is_arch_support_pdl: CUDA (not ROCm/MUSA) at SM 9.0 or later.
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9


def _bindings(device_name: str | None) -> dict:
    """What the loaded definitions import from the rest of SGLang, as a CUDA server without expert
    parallelism, LoRA or deterministic mode has it."""
    import triton
    import triton.language as tl

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton: the engine then never asks for TMA
        TensorDescriptor = None
    serving = types.SimpleNamespace(deterministic=types.SimpleNamespace(enable_deterministic_inference=False))
    name = device_name

    def get_device_name(device_id: int = 0) -> str:
        return name if name is not None else torch.cuda.get_device_name(device_id)

    return {"torch": torch, "triton": triton, "tl": tl, "F": F, "functools": functools, "json": json, "os": os,
            "OrderedDict": OrderedDict, "TensorDescriptor": TensorDescriptor, "is_arch_support_pdl": _pdl,
            "get_device_name": get_device_name, "get_exec": lambda: serving, "_is_cuda": True, "_is_hip": False,
            "_SGLANG_EXPERIMENTAL_LORA_OPTI": False}


class CudaAlign:
    """The engine's CUDA ``moe_align_block_size`` (more than 64 pairs, or at most 63 experts): from
    ``sgl_kernel`` when it imports, else built from the wheel's source with apache-tvm-ffi and nvcc."""

    def __init__(self, root: Path):
        self.root = root
        self.fn = None
        self.source: str | None = None
        self.why_not: str | None = None

    def load(self) -> bool:
        """Find or build the kernel (host work only: a compile, no launch); False with ``why_not`` set if none."""
        if self.fn is not None or self.why_not is not None:
            return self.fn is not None
        aot = _sgl_kernel()
        if aot is not None:
            self.fn, self.source = aot.moe_align_block_size, f"CUDA (sgl_kernel {_dist_version('sglang-kernel')})"
            return True
        if importlib.util.find_spec("tvm_ffi") is None:
            self.why_not = ("its CUDA moe_align_block_size needs sgl_kernel or apache-tvm-ffi "
                            "(pip install --no-deps apache-tvm-ffi) and nvcc")
            return False
        try:
            self.fn = self._build()
            self.source = f"CUDA (sglang's {ALIGN_CU} built with tvm-ffi {_dist_version('apache-tvm-ffi')})"
        except Exception as exc:  # noqa: BLE001 - no nvcc, a compile error: the reason goes in the results
            self.why_not = f"building its CUDA moe_align_block_size failed: {type(exc).__name__}: {_first_line(exc)}"
        return self.fn is not None

    def _build(self, capability: tuple[int, int] | None = None):
        """The tvm-ffi function, compiled for ``capability`` (default: this GPU's)."""
        import tvm_ffi.cpp

        major, minor = capability or torch.cuda.get_device_capability()
        suffix = "a" if major >= 9 else ""  # SGLang's JIT targets the arch-specific variant on Hopper and later
        # tvm-ffi adds one -gencode per entry of this list (without it, it asks nvidia-smi for the GPU's)
        os.environ["TVM_FFI_CUDA_ARCH_LIST"] = f"{major}.{minor}{suffix}"
        # The wrapper SGLang's JIT loader generates for this op (int32 ids, no optional outputs).
        source = "\n".join([
            "#include <tvm/ffi/container/tensor.h>", "#include <tvm/ffi/dtype.h>", "#include <tvm/ffi/error.h>",
            "#include <tvm/ffi/extra/c_env_api.h>", "#include <tvm/ffi/function.h>",
            f'#include "{self.root / ALIGN_CU}"',
            "namespace sglang {",
            "TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_align_block_size, "
            "(MoeAlignBlockSizeKernel<int32_t, false, false, false>::run));",
            "}  // namespace sglang", ""])
        module = tvm_ffi.cpp.load_inline(
            f"moekit_sglang_moe_align_{(version() or 'x').replace('.', '_')}_sm{major}{minor}{suffix}",
            cuda_sources=source,
            extra_cflags=["-std=c++20", "-O3"],
            extra_cuda_cflags=[f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}", "-std=c++20", "-O3",
                               "--expt-relaxed-constexpr"],
            extra_include_paths=[str(self.root / JIT_INCLUDE)])
        return module.moe_align_block_size

    def __call__(self, topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad,
                 cumsum_buffer, pad_sorted_token_ids=False, ignore_invalid_expert=False):
        # the signature of sglang.kernels.ops.moe.moe_align_block_size, which the engine's dispatch calls
        if not self.load():
            raise RuntimeError(f"sglang peer: {self.why_not}")
        self.fn(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad, cumsum_buffer,
                pad_sorted_token_ids)


@functools.cache
def _sgl_kernel():
    """SGLang's compiled kernels, where they import (a full sglang install on its own torch), else None."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return None
    try:
        import sgl_kernel
    except Exception:  # noqa: BLE001 - built for another torch or CUDA: the peer does without it
        return None
    return sgl_kernel


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


class Sglang:
    """The engine's definitions, loaded once per device name. ``device_name``: the name the config lookup
    uses (default: the CUDA device's; given, the lookup runs without a GPU)."""

    def __init__(self, device_name: str | None = None, root: Path | None = None):
        root = root or package_dir()
        if root is None:
            raise LoadError(f"sglang is not installed ({INSTALL})")
        self.root, self.version = root, version()
        env = _bindings(device_name)
        self.messages = _Messages()
        log = logging.Logger("moekit.sglang_peer.config")  # not registered: its lines stay here
        log.addHandler(self.messages)
        self.kernels = definitions(root / KERNELS, [
            "write_zeros_to_output", "fused_moe_kernel", "_TMA_ALLOCATOR_SET", "_set_triton_tma_allocator",
            "_B_DESC_CACHE_MAX", "_B_DESC_CACHE", "_get_b_tma_desc_cached", "invoke_fused_moe_kernel", "tanh",
            "_apply_activation", "act_and_mul_kernel", "act_and_mul_triton", "_moe_sum_reduce_kernel",
            "moe_sum_reduce_triton"], env)
        small = definitions(root / SMALL_ALIGN, ["SMALL_NUMEL_LIMIT", "_moe_align_small_numel_kernel",
                                                 "moe_align_small_numel"], env)
        self.cuda_align = CudaAlign(root)
        self.small_numel_limit = small.SMALL_NUMEL_LIMIT
        self.align = definitions(root / ALIGN, ["_CUDA_SMALL_BATCH_MAX_BUCKETS", "moe_align_block_size"], dict(
            env, SMALL_NUMEL_LIMIT=small.SMALL_NUMEL_LIMIT, moe_align_small_numel=small.moe_align_small_numel,
            sgl_moe_align_block_size=self.cuda_align))
        self.config = definitions(root / CONFIG, ["get_config_file_name", "get_moe_configs", "get_default_config",
                                                  "get_config_dtype_str"], dict(env, logger=log))
        self.runner = definitions(root / RUNNER, ["swiglu_gpt_oss_sigmoid_alpha"], env)
        self._plans: dict = {}
        self._tables: dict = {}

    # -- the engine's choices for a shape ------------------------------------------------------------------

    def uses_cuda_align(self, num_pairs: int, num_experts: int) -> bool:
        """The engine's align dispatch: its Triton kernel for few pairs and many experts, else CUDA."""
        return not (num_pairs <= self.small_numel_limit
                    and num_experts + 1 > self.align._CUDA_SMALL_BATCH_MAX_BUCKETS)

    def plan(self, num_tokens: int, num_experts: int, two_i: int, hidden: int, top_k: int,
             dtype: torch.dtype = torch.bfloat16) -> dict:
        """The engine's configs for one call (its ``try_get_optimal_moe_config`` with the down config, as
        ``_prepare_fused_moe_run`` asks): the tuned entry nearest to ``num_tokens`` in its file for
        (E, N = I, device name), else its default; and where they came from."""
        key = (num_tokens, num_experts, two_i, hidden, top_k, dtype)
        if key in self._plans:
            return self._plans[key]
        cfg_dtype = self.config.get_config_dtype_str(dtype)
        inter = two_i // 2
        up_table, up_source = self._table(num_experts, inter, cfg_dtype, down=False)
        if up_table:
            config = dict(up_table[min(up_table, key=lambda m: abs(m - num_tokens))])
        else:
            config = dict(self.config.get_default_config(num_tokens, num_experts, inter, hidden, top_k, cfg_dtype,
                                                         False, None))
        down_table, down_source = self._table(num_experts, inter, cfg_dtype, down=True)
        down = dict(down_table[min(down_table, key=lambda m: abs(m - num_tokens))]) if down_table else None
        if down is not None:
            down["BLOCK_SIZE_M"] = config["BLOCK_SIZE_M"]  # one alignment serves both GEMMs
        tma = self.kernels.invoke_fused_moe_kernel.__globals__["TensorDescriptor"] is not None
        plan = {"config": config, "down_config": down, "up_tma": tma and bool(config.pop("USE_TMA", False)),
                "down_tma": bool(down.pop("USE_TMA", False)) if down else False,
                "config_source": up_source, "down_config_source": down_source}
        self._plans[key] = plan
        return plan

    def _table(self, num_experts, inter, cfg_dtype, down):
        """The engine's tuned table for a shape (None: it uses its default) and which file it read."""
        key = (num_experts, inter, cfg_dtype, down)
        if key not in self._tables:
            before = len(self.messages.lines)
            table = self.config.get_moe_configs(num_experts, inter, cfg_dtype, 0, 0, False, down)
            said = " ".join(self.messages.lines[before:])
            name = self.config.get_config_file_name(num_experts, inter, cfg_dtype, [0, 0], False, down)
            read = re.findall(r"config from (.+?\.json)", said)
            if table is None:
                source = f"default (no tuned file {name})"
            elif "reusing the tuned up-projection config" in said:
                source = "the up-projection's file"
            else:
                folder = self.root / Path(CONFIG).parent / "configs"
                where = os.path.relpath(read[-1], folder) if read else name
                source = f"tuned {where}" + (" (another Triton version's file)" if "Fallback" in said else "")
            self._tables[key] = table, source
        return self._tables[key]

    def why_not(self, spec, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
        """None if the peer can run this case here, else why not (before any GPU work)."""
        if dtype not in (torch.bfloat16, torch.float16):
            return "bf16/fp16 only"
        if spec.activation not in ("silu_and_mul", "swiglu_oai"):
            return f"no {spec.activation}"
        plan = self.plan(num_tokens, spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size, spec.top_k, dtype)
        if plan["down_tma"]:
            return "its tuned config asks for the TMA down path, which this peer does not run"
        if self.uses_cuda_align(num_tokens * spec.top_k, spec.num_experts) and not self.cuda_align.load():
            return self.cuda_align.why_not
        return None

    def describe(self, spec, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> dict:
        """Which config, alignment and combine serve this case (for the results)."""
        plan = self.plan(num_tokens, spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size, spec.top_k, dtype)
        cuda = self.uses_cuda_align(num_tokens * spec.top_k, spec.num_experts)
        return {"config": plan["config_source"], "kernel_config": dict(plan["config"]),
                "align": (self.cuda_align.source or "CUDA") if cuda else "Triton moe_align_small_numel",
                "combine": self._combine_name(num_tokens, spec.top_k)}

    def _sum_kernel(self, num_tokens: int):
        aot = _sgl_kernel()
        if num_tokens > 32 and aot is not None:
            return aot.moe_sum_reduce
        return self.kernels.moe_sum_reduce_triton

    def _combine_name(self, num_tokens, top_k):
        if top_k == 2:
            return "torch.add"
        fn = self._sum_kernel(num_tokens)
        if fn is self.kernels.moe_sum_reduce_triton:
            return "Triton moe_sum_reduce"
        return "CUDA moe_sum_reduce (sgl_kernel)"

    # -- the call -----------------------------------------------------------------------------------------

    def fused_experts(self, x, w13, w2, topk_weights, topk_ids, activation="silu_and_mul", w13_bias=None,
                      w2_bias=None):
        """The engine's bf16 Triton MoE call on moekit's operands: x [T, H]; w13 [E, 2I, H] ([gate; up], or
        interleaved for ``swiglu_oai``); w2 [E, H, I]; topk_weights fp32 and topk_ids int32 [T, k]."""
        import triton.language as tl

        T, H = x.shape
        k = topk_ids.shape[1]
        E, two_i, _ = w13.shape
        plan = self.plan(T, E, two_i, H, k, x.dtype)
        config, down = plan["config"], plan["down_config"] or plan["config"]
        sorted_ids, expert_ids, padded = self.align.moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], E)
        quant = dict(compute_type=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, use_fp8_w8a8=False,
                     use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                     block_shape=None)
        gate_up = torch.empty(T * k, two_i, device=x.device, dtype=x.dtype)
        self.kernels.invoke_fused_moe_kernel(x, w13, w13_bias, gate_up, None, None, None, topk_weights, topk_ids,
                                             sorted_ids, expert_ids, padded, False, k, config,
                                             b_use_tma=plan["up_tma"], **quant)
        if activation == "swiglu_oai":
            act = self.runner.swiglu_gpt_oss_sigmoid_alpha(gate_up, GPT_OSS_ALPHA, GPT_OSS_LIMIT)
        else:
            act = torch.empty(T * k, two_i // 2, device=x.device, dtype=x.dtype)
            self.kernels.act_and_mul_triton(gate_up, act, config, activation="silu")
        per_slot = torch.empty(T, k, H, device=x.device, dtype=x.dtype)
        self.kernels.invoke_fused_moe_kernel(act, w2, w2_bias, per_slot, None, None, None, topk_weights, topk_ids,
                                             sorted_ids, expert_ids, padded, True, 1, down, router_topk=k, **quant)
        out = torch.empty(T, H, device=x.device, dtype=x.dtype)
        if k == 2:
            torch.add(per_slot[:, 0], per_slot[:, 1], out=out)
        elif k == 1:
            out.copy_(per_slot[:, 0])
        else:
            self._sum_kernel(T)(per_slot, out, 1.0)
        return out


@functools.cache
def load(device_name: str | None = None) -> Sglang:
    """The peer for this process (one per device name)."""
    return Sglang(device_name)
