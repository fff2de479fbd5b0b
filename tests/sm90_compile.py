"""Compile moekit's Triton kernels for the H200 (sm_90) on a machine without a GPU.

Triton's NVIDIA backend (with ptxas) ships in its wheel, so a fake driver that reports an sm_90
target is enough to build real cubins. The public API is called on CPU tensors with launches
turned into compile-only warmups, so exactly the constexpr variants the host code picks are
built. Prints registers, spills and shared memory per variant; exits non-zero on any failure
or spill.

    python tests/sm90_compile.py            (tests/test_sm90_compile.py runs it in CI)
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit.tools import _sass  # noqa: E402
from moekit.tools._fake_sm90 import Sm90Driver as _Sm90Driver  # noqa: E402


BUILT: list[tuple[str, object]] = []
MAX_SPILL_BYTES = 16
# Variants whose spills inside loops were measured and kept: each was faster than every spill-free config tried.
LOOP_SPILLS_MEASURED = {
    # W4A8 GEMM1 at 128-row blocks on 16 warps (128 registers): 3737 us at T=4096 against 5194 for 64-row blocks
    # without spills (benchmarks/results/archive/w4a8_configs_2026-12-04.md, 2026-12-04)
    ("w4a8 gpt-oss-120b T=4096", "gemm1_act_kernel"),
    ("w4a8 gpt-oss-120b T=4096 [pairs]", "gemm1_act_kernel"),  # the same tile on prepared codes (no reorder left)
    # the same tile in batch-invariant mode (only its half tails off)
    ("invariant mxfp4+w4a8 gpt-oss-120b T=4096", "gemm1_act_kernel"),
    ("invariant mxfp4+w4a8 gpt-oss-120b T=16384", "gemm1_act_kernel"),
}


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    BUILT.append((self.__name__, kernel))
    return kernel


_ORIGINAL_RUN = JITFunction.run


_USAGE: dict[str, dict] = {}


def resource_usage(kernel) -> dict:
    """Registers, stack frame and spill bytes, as ptxas reports them for this kernel's PTX (once per
    kernel: many variants build the same one)."""
    if kernel.hash not in _USAGE:
        _USAGE[kernel.hash] = _sass.ptxas_usage(kernel.asm["ptx"])[0]
    return _USAGE[kernel.hash]


def variants():
    """(label, thunk) pairs: every kernel family at the shapes that pick different constexprs."""
    from moekit import presets
    from moekit.routing.router import RouterLoRA, fused_router, router_gemm
    from moekit.routing import route

    def inputs(T, spec, H=None):
        H = H or spec.hidden_size
        x = torch.randn(T, H).bfloat16()
        w = torch.randn(spec.num_experts, H).bfloat16()
        b = torch.randn(spec.num_experts).bfloat16() if spec.router_bias else None
        kw = spec.routing_kwargs()
        if spec.correction_bias:
            kw["correction_bias"] = torch.randn(spec.num_experts)
        return x, w, b, kw

    for name in ("gpt-oss-120b", "deepseek-v3", "kimi-k2", "qwen3-30b-a3b", "mixtral-8x7b"):
        spec = presets.get(name)
        for T in (1, 8, 16, 128):
            x, w, b, kw = inputs(T, spec)
            yield f"fused {name} T={T}", lambda x=x, w=w, b=b, kw=kw, s=spec: fused_router(
                x, w, b, top_k=s.top_k, method=s.routing, impl="fused", **kw)
        for T in (1, 4, 64, 1024):
            x, w, b, kw = inputs(T, spec)
            yield f"gemm {name} T={T}", lambda x=x, w=w, b=b: router_gemm(x, w, b, tier="triton")
        logits = torch.randn(64, spec.num_experts)
        yield f"route {name}", lambda lg=logits, s=spec, kw=inputs(1, spec)[3]: route(
            lg, s.top_k, s.routing, impl="triton", **kw)
    for E, G, TG, k in ((21, 3, 2, 6), (24, 3, 2, 6), (12, 4, 2, 3)):  # groups the reshape path cannot take
        logits = torch.randn(64, E)
        yield f"route grouped E={E} G={G}", lambda lg=logits, G=G, TG=TG, k=k: route(
            lg, k, "sigmoid_grouped", num_groups=G, topk_groups=TG, impl="triton")
        x, w = torch.randn(8, 256).bfloat16(), torch.randn(E, 256).bfloat16()
        yield f"fused grouped E={E} G={G}", lambda x=x, w=w, G=G, TG=TG, k=k: fused_router(
            x, w, top_k=k, method="sigmoid_grouped", num_groups=G, topk_groups=TG, impl="fused")
    spec = presets.get("gpt-oss-120b")
    x, w, b, _ = inputs(9, spec)
    lora = RouterLoRA(torch.randn(16, spec.hidden_size).bfloat16(), torch.randn(spec.num_experts, 16), 0.5)
    yield "gemm lora r=16 T=9", lambda: router_gemm(x, w, b, lora=lora, tier="triton")
    yield "fused lora r=16 T=9", lambda: fused_router(x, w, b, top_k=4, method="topk_softmax", lora=lora, impl="fused")
    x32, w32 = torch.randn(33, 64), torch.randn(8, 64)
    yield "gemm fp32 (ieee dot) T=33", lambda: router_gemm(x32, w32, tier="triton")
    yield from expert_variants()


def expert_variants():
    """The expert kernels at every preset's shapes and the token counts that pick other configs.
    Weights are one expert expanded to E (stride 0): compiling needs shapes, not gigabytes."""
    from moekit import presets
    from moekit.experts import batched_experts, fused_experts

    def weights(spec, dtype=torch.bfloat16):
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13 = torch.empty(1, 2 * I, H, dtype=dtype).expand(E, -1, -1)
        w2 = torch.empty(1, H, I, dtype=dtype).expand(E, -1, -1)
        biases = (torch.empty(E, 2 * I, dtype=dtype), torch.empty(E, H, dtype=dtype)) if spec.expert_bias else (None, None)
        return w13, w2, biases

    for name in ("gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
        spec = presets.get(name)
        w13, w2, (b13, b2) = weights(spec)
        for T in (1, 16, 64, 1024, 16384):
            x = torch.empty(T, spec.hidden_size, dtype=torch.bfloat16)
            ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
            yield f"experts {name} T={T}", lambda x=x, ids=ids, w13=w13, w2=w2, b13=b13, b2=b2, s=spec: fused_experts(
                x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2,
                backend="triton")
        xb = torch.empty(spec.num_experts, 64, spec.hidden_size, dtype=torch.bfloat16)
        counts = torch.zeros(spec.num_experts, dtype=torch.int32)
        yield f"batched {name} M=64", lambda xb=xb, c=counts, w13=w13, w2=w2, b13=b13, b2=b2, s=spec: batched_experts(
            xb, c, w13, w2, activation=s.activation, w13_bias=b13, w2_bias=b2, backend="triton")
    from moekit.formats import mxfp4, nvfp4, prepare

    for (name, mod), layout in itertools.product((("gpt-oss-120b", mxfp4), ("qwen3-30b-a3b", nvfp4)),
                                                 ("packed", "pairs")):  # W4A16: each model's 4-bit format
        spec = presets.get(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        one13, one2 = mod.quantize(torch.randn(1, 2 * I, H)), mod.quantize(torch.randn(1, H, I))
        if layout == "pairs":
            one13, one2 = prepare(one13), prepare(one2)
        q13, q2 = (_expand_quantized(mod, one13, E), _expand_quantized(mod, one2, E))
        b13, b2 = (torch.empty(E, 2 * I, dtype=torch.bfloat16), torch.empty(E, H, dtype=torch.bfloat16)) \
            if spec.expert_bias else (None, None)
        tag = "" if layout == "packed" else " [pairs]"
        for T in (1, 16, 1024):
            x = torch.empty(T, H, dtype=torch.bfloat16)
            ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
            yield f"{mod.__name__.split('.')[-1]} {name} T={T}{tag}", lambda x=x, ids=ids, q13=q13, q2=q2, b13=b13, b2=b2, s=spec: \
                fused_experts(x, q13, q2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13,
                              w2_bias=b2, backend="triton")
        if mod is mxfp4:  # W4A8: the heuristic's three regimes (16-, 64-, 128-row blocks)
            for T in (16, 1024, 4096):
                x = torch.empty(T, H, dtype=torch.bfloat16)
                ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
                yield f"w4a8 {name} T={T}{tag}", lambda x=x, ids=ids, q13=q13, q2=q2, b13=b13, b2=b2, s=spec: fused_experts(
                    x, q13, q2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2,
                    act_quant="fp8_group", backend="triton")
    from moekit.formats import fp8

    spec = presets.get("deepseek-v3")  # W8A8: E4M3 tensor cores, 128x128 block and per-channel weight scales
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    for gran, quantize in (("block", fp8.quantize_blocks), ("channel", fp8.quantize_per_channel)):
        one13, one2 = quantize(torch.randn(1, 2 * I, H)), quantize(torch.randn(1, H, I))
        grow = lambda t: fp8.FP8Tensor(t.data.expand(E, -1, -1), t.scale.expand(E, -1, -1), t.granularity)  # noqa: E731
        q13, q2 = grow(one13), grow(one2)
        for T in (1, 16, 1024, 16384):
            x = torch.empty(T, H, dtype=torch.bfloat16)
            ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
            yield f"fp8 {gran} {spec.name} T={T}", lambda x=x, ids=ids, q13=q13, q2=q2: fused_experts(
                x, q13, q2, torch.zeros(ids.shape), ids, act_quant="fp8_group", backend="triton")
    from moekit.experts.configs import ExpertsConfig, GemmConfig

    decode = ExpertsConfig(16, GemmConfig(16, 256, 4, 1), GemmConfig(8, 512, 8, 1), mode="gemv", pdl=True)
    for name, mod in (("qwen3-30b-a3b", None), ("gpt-oss-120b", mxfp4)):  # GEMM2 as GEMM1's dependent launch
        spec = presets.get(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13, w2 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=torch.bfloat16)
        if mod is not None:
            w13, w2 = (_expand_quantized(mod, mod.quantize(torch.randn(1, *t.shape[1:])), E) for t in (w13, w2))
        x, ids = torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, spec.top_k, dtype=torch.int32)
        yield f"pdl decode {name}", lambda x=x, ids=ids, w13=w13, w2=w2, s=spec: fused_experts(
            x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=decode)
        slots = replace(decode, pdl=False, gemm2=GemmConfig(4, 512, 8, 1, slots=spec.top_k),  # every slot per step
                        gemm1=GemmConfig(4, 256, 4, 1, slots=spec.top_k) if mod else decode.gemm1)
        yield f"slots decode {name}", lambda x=x, ids=ids, w13=w13, w2=w2, s=spec, c=slots: fused_experts(
            x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=c)

    # the H100 table's gpt-oss-120b bf16 T=1 entry: its GEMV1 (211 registers uncapped) at GemmConfig.maxnreg 168
    spec = presets.get("gpt-oss-120b")
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    capped = ExpertsConfig(16, GemmConfig(16, 256, 4, 1, maxnreg=168), GemmConfig(8, 1024, 4, 1, slots=1),
                           mode="gemv", pdl=True)
    w13, w2 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=torch.bfloat16)
    x, ids = torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, spec.top_k, dtype=torch.int32)
    b13, b2 = torch.empty(E, 2 * I, dtype=torch.bfloat16), torch.empty(E, H, dtype=torch.bfloat16)
    yield "capped decode gpt-oss-120b maxnreg 168", lambda x=x, ids=ids, w13=w13, w2=w2, s=spec: fused_experts(
        x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2, backend="triton",
        config=capped)

    # row-scaled decode (GemmConfig.row_scaled): MXFP4 with interleaved rows, NVFP4 with [gate; up] halves
    from moekit.formats import nvfp4
    for name, mod in (("gpt-oss-120b", mxfp4), ("qwen3-30b-a3b", nvfp4)):
        spec = presets.get(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13, w2 = (_expand_quantized(mod, mod.quantize(torch.randn(1, *shape)), E) for shape in ((2 * I, H), (H, I)))
        x, ids = torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, spec.top_k, dtype=torch.int32)
        for bn, warps in ((8, 4), (16, 4), (4, 2)):  # GEMM2 row-scaled too, at the decode tile of each format
            cfg = replace(decode, gemm1=GemmConfig(bn, 1024, warps, 3, row_scaled=True),
                          gemm2=replace(decode.gemm2, row_scaled=True))
            yield f"rows decode {name} BLOCK_N={bn} w{warps}", \
                lambda x=x, ids=ids, w13=w13, w2=w2, s=spec, c=cfg: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=c)
        bk = 1024 if I >= 2048 else 256  # GEMM2 per pair (gemv2_rows): the tuner's candidates (tools/tune.py)
        for bn, bk, stages in ((8, bk, 3), (16, bk, 3), (32, bk, 3), (32, bk, 2), (16, 512, 2)):
            cfg = replace(decode, split_slots=True, gemm1=GemmConfig(8, 1024, 4, 3, row_scaled=True),
                          gemm2=GemmConfig(bn, bk, 4, stages, row_scaled=True))
            yield f"rows decode, GEMM2 per pair {name} BLOCK_N={bn} BLOCK_K={bk} s{stages}", \
                lambda x=x, ids=ids, w13=w13, w2=w2, s=spec, c=cfg: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=c)
        cfg = replace(cfg, pdl=False)  # GEMM2 without the dependent launch: no first chunk ahead of the wait
        yield f"rows decode, GEMM2 per pair {name} no PDL", \
            lambda x=x, ids=ids, w13=w13, w2=w2, s=spec, c=cfg: fused_experts(
                x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=c)
        # the per-pair tensor-core mode with GEMM2 per pair: the aligned GEMMs' 4-bit tiles on per-pair rows
        cfg = ExpertsConfig(16, GemmConfig(64, 64, 4, 4), GemmConfig(64, 64, 4, 4), mode="per_pair", split_slots=True)
        yield f"per-pair tensor-core, GEMM2 per pair {name}", \
            lambda x=x, ids=ids, w13=w13, w2=w2, s=spec, c=cfg: fused_experts(
                x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=c)

    # TMA weight boxes: the experts must be back to back (no stride 0); gpt-oss's interleaved rows take paired boxes
    for name in ("qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"):
        spec = presets.get(name)
        E, H, I = 4, spec.hidden_size, spec.intermediate_size
        w13, w2 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=torch.bfloat16)
        x = torch.empty(4096, H, dtype=torch.bfloat16)
        ids = torch.zeros(4096, spec.top_k, dtype=torch.int32) % E
        for bm, g1, g2 in ((128, GemmConfig(128, 64, 8, 4, 8, tma=True), GemmConfig(256, 64, 8, 4, 8, tma=True)),
                           (64, GemmConfig(64, 128, 4, 3, 8, tma=True), GemmConfig(128, 128, 4, 3, 8, tma=True))):
            for half in (False, True):  # half: both row counts in one kernel (shared memory of two loops)
                cfg = ExpertsConfig(bm, replace(g1, half_tails=half), replace(g2, half_tails=half))
                yield f"tma {name} BM={bm}{' half tails' if half else ''}", \
                    lambda x=x, ids=ids, w13=w13, w2=w2, cfg=cfg, s=spec: fused_experts(
                        x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=cfg)
        if spec.activation != "silu_and_mul":
            continue
        q13, q2 = fp8.quantize_blocks(torch.randn(E, 2 * I, H)), fp8.quantize_blocks(torch.randn(E, H, I))
        for half in (False, True):
            cfg = ExpertsConfig(64, GemmConfig(128, 128, 8, 3, 8, tma=True, half_tails=half),
                                GemmConfig(128, 128, 4, 4, 8, tma=True, half_tails=half))
            yield f"tma fp8 block {name} BM=64{' half tails' if half else ''}", \
                lambda x=x, ids=ids, q13=q13, q2=q2, cfg=cfg: fused_experts(
                    x, q13, q2, torch.zeros(ids.shape), ids, act_quant="fp8_group", backend="triton", config=cfg)
    yield from lora_variants()
    yield from invariant_variants()
    spec = presets.get("mixtral-8x7b").scaled()
    w13, w2, _ = weights(spec, torch.float32)
    x = torch.empty(40, spec.hidden_size)
    emap = torch.zeros(2 * spec.num_experts, dtype=torch.int32)
    yield "experts fp32 (ieee dot), expert_map", lambda: fused_experts(
        x, w13, w2, torch.zeros(40, 2), torch.zeros(40, 2, dtype=torch.int32), expert_map=emap, backend="triton")


SM90_MAX_SMEM = 232448  # bytes of shared memory one block may use on sm_90 (227 KB): more fails at launch


def invariant_variants():
    """Batch-invariant mode's configurations (the H200 table's tiles with the shape's K step and stages scaled to
    keep its bytes in flight) at the presets' shapes, T from decode to prefill; the router with one K split. Their
    shared memory is checked too (main): a variant past sm_90's 227 KB would only fail at launch."""
    import contextlib

    from moekit import _invariant, presets
    from moekit.experts import configs, fused_experts
    from moekit.formats import fp8, mxfp4, nvfp4
    from moekit.routing.router import RouterLoRA, fused_router, router_gemm

    h200 = configs.table_key  # CPU tensors would key the table as "cpu": ask for the H200's entries

    @contextlib.contextmanager
    def on_h200():
        configs.table_key = lambda device, dtype, fmt="dense": (
            f"NVIDIA H200|triton-3.6.0|{str(dtype).removeprefix('torch.')}" + ("" if fmt == "dense" else f"|{fmt}"))
        try:
            with _invariant.batch_invariant():
                yield
        finally:
            configs.table_key = h200

    def invariant(thunk):
        def run():
            with on_h200():
                thunk()
        return run

    cases = [(name, None, None) for name in ("gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")]
    cases += [("gpt-oss-120b", mxfp4, None), ("qwen3-30b-a3b", nvfp4, None), ("gpt-oss-120b", mxfp4, "fp8_group"),
              ("deepseek-v3", fp8, "fp8_group")]
    for name, mod, act_quant in cases:
        spec = presets.get(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        if mod is fp8:
            grow = lambda t: fp8.FP8Tensor(t.data.expand(E, -1, -1), t.scale.expand(E, -1, -1), t.granularity)  # noqa: E731
            w13, w2 = grow(fp8.quantize_blocks(torch.randn(1, 2 * I, H))), grow(fp8.quantize_blocks(torch.randn(1, H, I)))
        elif mod is not None:
            w13, w2 = (_expand_quantized(mod, mod.quantize(torch.randn(1, *shape)), E) for shape in ((2 * I, H), (H, I)))
        else:
            w13 = torch.empty(1, 2 * I, H, dtype=torch.bfloat16).expand(E, -1, -1)
            w2 = torch.empty(1, H, I, dtype=torch.bfloat16).expand(E, -1, -1)
        b13, b2 = (torch.empty(E, 2 * I, dtype=torch.bfloat16), torch.empty(E, H, dtype=torch.bfloat16)) \
            if spec.expert_bias and mod is not fp8 else (None, None)
        fmt = "bf16" if mod is None else mod.__name__.split(".")[-1] + ("+w4a8" if act_quant and mod is mxfp4 else "")
        for T in (1, 16, 64, 256, 1024, 4096, 16384):
            x = torch.empty(T, H, dtype=torch.bfloat16)
            ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
            yield f"invariant {fmt} {name} T={T}", invariant(
                lambda x=x, ids=ids, w13=w13, w2=w2, b13=b13, b2=b2, s=spec, aq=act_quant: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2,
                    act_quant=aq, backend="triton"))
    # every tile the mode picks (routing/tiers.py _invariant_tile), folded and not; the fused kernel up to T=64
    for name in ("qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "kimi-k2", "mixtral-8x7b"):
        spec = presets.get(name)
        w = torch.randn(spec.num_experts, spec.hidden_size).bfloat16()
        b = torch.randn(spec.num_experts) if spec.router_bias else None
        lora = RouterLoRA(torch.randn(16, spec.hidden_size).bfloat16(), torch.randn(spec.num_experts, 16), 0.5)
        kw = spec.routing_kwargs()
        for T in (1, 16, 64, 257, 1024, 4096, 16384):
            x = torch.randn(T, spec.hidden_size).bfloat16()
            yield f"invariant gemm {name} T={T}", invariant(lambda x=x, w=w, b=b: router_gemm(x, w, b, tier="triton"))
            yield f"invariant gemm lora {name} T={T}", invariant(
                lambda x=x, w=w, b=b, lora=lora: router_gemm(x, w, b, lora=lora, tier="triton"))
            if T <= 64:
                yield f"invariant fused {name} T={T}", invariant(
                    lambda x=x, w=w, b=b, kw=kw, s=spec: fused_router(x, w, b, top_k=s.top_k, method=s.routing,
                                                                      impl="fused", **kw))
            if name in ("qwen3-30b-a3b", "deepseek-v3"):  # fp32 inputs: the ieee dot's tiles, twice the bytes
                yield f"invariant gemm fp32 {name} T={T}", invariant(
                    lambda x=x.float(), w=w.float(), b=b: router_gemm(x, w, b, tier="triton"))


def lora_variants():
    """Expert LoRA (rank 16, four adapters) in each mode's kernels at the benchmark's shapes, on bf16, MXFP4 and FP8
    W8A8 bases, and rank 256 (the largest: the smallest tiles)."""
    from moekit import presets
    from moekit.experts import ExpertsConfig, ExpertsLoRA, GemmConfig, batched_experts, fused_experts
    from moekit.formats import fp8, mxfp4

    def lora(E, H, I, r=16, n=4):
        one = lambda *shape: torch.empty(n, 1, *shape, dtype=torch.bfloat16).expand(n, E, *shape)  # noqa: E731
        return ExpertsLoRA(one(r, H), one(2 * I, r), one(r, I), one(H, r), scaling=[1.0] * n)

    gemv = ExpertsConfig(16, GemmConfig(16, 256, 4, 1), GemmConfig(8, 512, 8, 1), mode="gemv")
    per_pair = ExpertsConfig(16, GemmConfig(64, 128, 4, 3), GemmConfig(64, 128, 4, 3), mode="per_pair")
    # the tuned H200 shape of qwen3-30b-a3b's decode: GEMV2 with 4 slots per step, PDL
    decode_pdl = ExpertsConfig(16, GemmConfig(16, 256, 4, 1), GemmConfig(4, 256, 4, 1, slots=4), mode="gemv", pdl=True)
    for name in ("qwen3-30b-a3b", "gpt-oss-120b"):
        spec = presets.get(name)
        E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
        w13 = torch.empty(1, 2 * I, H, dtype=torch.bfloat16).expand(E, -1, -1)
        w2 = torch.empty(1, H, I, dtype=torch.bfloat16).expand(E, -1, -1)
        ad = lora(E, H, I)
        for T, cfg in ((1, gemv), (1, per_pair), (16, None), (4096, None)):
            x = torch.empty(T, H, dtype=torch.bfloat16)
            ids = torch.zeros(T, k, dtype=torch.int32)
            lids = torch.zeros(T, dtype=torch.int32)
            yield f"lora {name} T={T}{' ' + cfg.mode if cfg else ''}", \
                lambda x=x, ids=ids, lids=lids, w13=w13, w2=w2, ad=ad, cfg=cfg, s=spec: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=cfg,
                    lora=ad, lora_ids=lids)
        # contiguous stacks: the decode terms run inside the GEMVs (experts/lora.py decode_terms)
        dense = ExpertsLoRA(*(torch.empty(4, E, *t.shape[2:], dtype=torch.bfloat16)
                              for t in (ad.w13_a, ad.w13_b, ad.w2_a, ad.w2_b)), scaling=[1.0] * 4)
        # (the preset's expert biases too: gpt-oss-120b's GEMV1 with both terms builds in 227 registers with them)
        b13 = torch.empty(E, 2 * I, dtype=torch.bfloat16) if spec.expert_bias else None
        b2 = torch.empty(E, H, dtype=torch.bfloat16) if spec.expert_bias else None
        for T, cfg in ((1, gemv), (4, decode_pdl)):
            x, ids = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.int32)
            yield f"lora {name} T={T} decode terms in the GEMVs", \
                lambda x=x, ids=ids, w13=w13, w2=w2, dense=dense, cfg=cfg, s=spec, b13=b13, b2=b2: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2,
                    backend="triton", config=cfg, lora=dense, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32))
            # W13's shrink computed by GEMV1's programs (experts/lora.py DECODE_W13_SHRINK_BY_GEMV1)
            yield f"lora {name} T={T} decode terms in the GEMVs, shrink by GEMV1", _shrink_by_gemv1(
                lambda x=x, ids=ids, w13=w13, w2=w2, dense=dense, cfg=cfg, s=spec, b13=b13, b2=b2: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, w13_bias=b13, w2_bias=b2,
                    backend="triton", config=cfg, lora=dense, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32)))
        # GEMV1's register cap with both terms (experts/lora.py DECODE_TERMS_MAXNREG) up to its padded rank, and the
        # ranks on either side of that limit (gpt-oss-120b's 180 column blocks take the separate kernels from r=32)
        for r in (8, 32, 64):
            wide = ExpertsLoRA(*(torch.empty(2, E, *shape, dtype=torch.bfloat16)
                                 for shape in ((r, H), (2 * I, r), (r, I), (H, r))), scaling=[1.0] * 2)
            x, ids = torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.int32)
            yield f"lora {name} T=1 decode terms in the GEMVs r={r}", \
                lambda x=x, ids=ids, w13=w13, w2=w2, wide=wide, s=spec: fused_experts(
                    x, w13, w2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=gemv,
                    lora=wide, lora_ids=torch.zeros(1, dtype=torch.int32))
        # 4-bit weights: GEMV1 on the rows kernel (one pair per program, 1024-code chunks) with the terms inside
        # (the H200 table's qwen3-30b-a3b NVFP4 T=4 shape; gpt-oss-120b's 360 column blocks take the separate kernels)
        rows = ExpertsConfig(16, GemmConfig(8, 1024, 4, 2, row_scaled=True), GemmConfig(8, 256, 4, 1, slots=0),
                             mode="gemv")
        q13, q2 = (_expand_quantized(mxfp4, mxfp4.quantize(torch.randn(1, *shape)), E) for shape in ((2 * I, H), (H, I)))
        for T in (1, 4):
            x, ids = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.int32)
            yield f"lora {name} T={T} mxfp4 decode terms in the rows GEMV1", \
                lambda x=x, ids=ids, q13=q13, q2=q2, dense=dense, s=spec: fused_experts(
                    x, q13, q2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=rows,
                    lora=dense, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32))
            yield f"lora {name} T={T} mxfp4 decode terms in the rows GEMV1, shrink by GEMV1", _shrink_by_gemv1(
                lambda x=x, ids=ids, q13=q13, q2=q2, dense=dense, s=spec: fused_experts(
                    x, q13, q2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton", config=rows,
                    lora=dense, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32)))
        xb = torch.empty(E, 64, H, dtype=torch.bfloat16)
        yield f"lora batched {name} M=64", lambda xb=xb, w13=w13, w2=w2, ad=ad, s=spec: batched_experts(
            xb, torch.zeros(xb.shape[0], dtype=torch.int32), w13, w2, activation=s.activation, backend="triton",
            lora=ad, lora_ids=torch.zeros(xb.shape[:2], dtype=torch.int32))
        if name == "qwen3-30b-a3b":
            x = torch.empty(256, H, dtype=torch.bfloat16)
            ids = torch.zeros(256, k, dtype=torch.int32)
            big = lora(E, H, I, r=256, n=2)
            yield f"lora r=256 {name} T=256", lambda x=x, ids=ids, w13=w13, w2=w2, big=big: fused_experts(
                x, w13, w2, torch.zeros(ids.shape), ids, backend="triton", lora=big,
                lora_ids=torch.zeros(256, dtype=torch.int32))
            x1, ids1 = torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.int32)
            yield f"lora r=256 {name} T=1 gemv", lambda x=x1, ids=ids1, w13=w13, w2=w2, big=big: fused_experts(
                x, w13, w2, torch.zeros(ids.shape), ids, backend="triton", config=gemv, lora=big,
                lora_ids=torch.zeros(1, dtype=torch.int32))
    spec = presets.get("gpt-oss-120b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    q13 = _expand_quantized(mxfp4, mxfp4.quantize(torch.randn(1, 2 * I, H)), E)
    q2 = _expand_quantized(mxfp4, mxfp4.quantize(torch.randn(1, H, I)), E)
    for T in (1, 256):
        x, ids = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.int32)
        yield f"lora mxfp4 {spec.name} T={T}", lambda x=x, ids=ids, q13=q13, q2=q2, ad=lora(E, H, I), s=spec: \
            fused_experts(x, q13, q2, torch.zeros(ids.shape), ids, activation=s.activation, backend="triton",
                          lora=ad, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32))
    spec = presets.get("qwen3-30b-a3b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    one13, one2 = fp8.quantize_blocks(torch.randn(1, 2 * I, H)), fp8.quantize_blocks(torch.randn(1, H, I))
    grow = lambda t: fp8.FP8Tensor(t.data.expand(E, -1, -1), t.scale.expand(E, -1, -1), t.granularity)  # noqa: E731
    for T in (1, 256):
        x, ids = torch.empty(T, H, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.int32)
        yield f"lora fp8 block {spec.name} T={T}", lambda x=x, ids=ids, q13=grow(one13), q2=grow(one2), ad=lora(E, H, I): \
            fused_experts(x, q13, q2, torch.zeros(ids.shape), ids, act_quant="fp8_group", backend="triton", lora=ad,
                          lora_ids=torch.zeros(x.shape[0], dtype=torch.int32))


def _shrink_by_gemv1(thunk):
    """``thunk`` run with W13's decode shrink computed by GEMV1's programs (experts/lora.py)."""
    def run():
        from moekit.experts import lora as expert_lora

        saved, expert_lora.DECODE_W13_SHRINK_BY_GEMV1 = expert_lora.DECODE_W13_SHRINK_BY_GEMV1, True
        try:
            return thunk()
        finally:
            expert_lora.DECODE_W13_SHRINK_BY_GEMV1 = saved
    return run


def _expand_quantized(mod, one, num_experts):
    """A 4-bit stack of one expert repeated (stride 0): shapes for compiling, not gigabytes."""
    grow = lambda t: t.expand(num_experts, *t.shape[1:])  # noqa: E731
    if mod.__name__.endswith("mxfp4"):
        return mod.MXFP4Tensor(grow(one.data), grow(one.scales), (num_experts, *one.shape[1:]), one.layout)
    return mod.NVFP4Tensor(grow(one.data), grow(one.scales), one.global_scale.expand(num_experts),
                           (num_experts, *one.shape[1:]), layout=one.layout)


def main() -> int:
    from moekit import _triton

    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    # every launch through Triton's own path (turned into warmups above), none through a bound kernel
    from moekit import _launch
    _launch.Launcher.launch = lambda self, grid, args, kwargs: self.fn[grid](*args, **kwargs)
    _launch.Launcher.prepare = lambda self, args, kwargs: None
    _triton.can_launch = lambda device: True  # CPU tensors stand in for CUDA ones
    _triton.num_sms = lambda device: 132  # the launch shapes of an H100 / H200, not the interpreter's 4
    _triton.fp8_tensor_cores = lambda device: True
    _triton.tma_copies = lambda device: True
    _triton.dependent_launches = lambda device: True
    from moekit.experts import triton_backend
    # ptxas's count (the fake driver loads nothing): GEMV1 with LoRA terms builds uncapped, then capped where that took
    # more registers (triton_backend._launch_with_terms), so both builds show
    triton_backend._kernel_registers = lambda kernel: resource_usage(kernel)["regs"]
    failures = 0
    rows = []
    only = sys.argv[1:]
    for label, thunk in variants():
        if only and not any(o in label for o in only):
            continue
        BUILT.clear()
        try:
            thunk()
        except Exception as exc:  # report every variant, then fail
            failures += 1
            rows.append((label, "-", "-", "-", f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"))
            continue
        for kname, kernel in BUILT:
            use = resource_usage(kernel)
            # ptxas sometimes parks one 64-bit value (8 bytes) even at 72 registers; that costs a
            # store/load pair. Past that, only spills inside a loop fail: values saved before the K
            # loop and reloaded for the epilogue cost nothing measurable (moekit/_sass.py).
            checked = use["spill"] > MAX_SPILL_BYTES
            in_loops = _sass.spills_in_loops(kernel) if checked else 0
            failures += (in_loops is None or in_loops > 0) and (label, kname) not in LOOP_SPILLS_MEASURED
            note = f"ok (stack {use['stack']})"
            if use["spill"]:
                where = {None: ", inside loops unknown (no nvdisasm)", 0: ", none inside loops"}.get(
                    in_loops, f", {in_loops} LDL/STL inside loops")
                note = f"spills {use['spill']} bytes" + (where if checked else "")
                if (label, kname) in LOOP_SPILLS_MEASURED:
                    note += " (measured and kept: LOOP_SPILLS_MEASURED)"
            if kernel.metadata.shared > SM90_MAX_SMEM:
                failures += 1
                note += f"; FAILED: {kernel.metadata.shared} bytes of shared memory (sm_90: {SM90_MAX_SMEM})"
            rows.append((label, kname, use["regs"], kernel.metadata.shared, note))
    for r in rows:
        print(f"{r[0]:34s} {r[1]!s:16s} regs={r[2]!s:4s} smem={r[3]!s:6s} {r[4]}")
    print(f"{len(rows)} variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
