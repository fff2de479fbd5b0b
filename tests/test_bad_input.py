"""Bad input through every public entry point: a clear ValueError/TypeError that names the argument,
raised before any kernel runs (never a wrong result, a crash, or an error from deep inside).

One table per family; each row says what is wrong. The kernel entry points run the same table on
the GPU (-m gpu), where the Triton kernels would otherwise be the ones to see the input.
"""

import types

import pytest
import torch

import moekit
from moekit import backends, layouts, presets, reference
from moekit.experts.configs import ExpertsConfig, GemmConfig
from moekit.formats import dequantize, expert, fp4, fp8, mxfp4, nvfp4, quantize_experts
from moekit.routing.router import RouterLoRA

E, H, I, T, K = 4, 64, 32, 3, 2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _valid(device):
    """Valid arguments of every op (fp32 on the CPU, bf16 on the GPU), drawn fresh."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    v = types.SimpleNamespace(device=device, dt=dt)
    v.x = torch.randn(T, H, device=device).to(dt)
    v.w13 = (torch.randn(E, 2 * I, H, device=device) * H ** -0.5).to(dt)
    v.w2 = (torch.randn(E, H, I, device=device) * I ** -0.5).to(dt)
    v.tw = torch.rand(T, K, device=device)
    v.tid = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().to(device)
    v.xb = torch.randn(E, 5, H, device=device).to(dt)
    v.counts = torch.tensor([5, 0, 2, 1], dtype=torch.int32, device=device)
    v.gate = (torch.randn(E, H, device=device) * H ** -0.5).to(dt)
    v.q13, v.q2 = quantize_experts(v.w13.float(), "mxfp4"), quantize_experts(v.w2.float(), "mxfp4")
    v.n13 = quantize_experts(v.w13.float(), "nvfp4")
    v.backend = "triton" if device == "cuda" else "auto"
    return v


# (why, call, error, message): the message names the argument, with expected and actual.
EXPERTS = [
    ("x of one dimension", lambda v: moekit.fused_experts(v.x[0], v.w13, v.w2, v.tw, v.tid, backend=v.backend),
     ValueError, r"x must have 2 dimensions, got shape \(64,\)"),
    ("x not a tensor", lambda v: moekit.fused_experts(v.x.tolist(), v.w13, v.w2, v.tw, v.tid), TypeError,
     "x must be a torch.Tensor, got list"),
    ("x sparse (COO)", lambda v: moekit.fused_experts(v.x.to_sparse(), v.w13, v.w2, v.tw, v.tid), ValueError,
     r"x must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("w13 sparse (CSR, which has no strides)", lambda v: moekit.fused_experts(
        v.x, v.w13.to_sparse_csr(dense_dim=1), v.w2, v.tw, v.tid), ValueError,
     r"w13 must be a dense \(strided\) tensor, got layout torch.sparse_csr"),
    ("x of an integer dtype", lambda v: moekit.fused_experts(v.x.int(), v.w13, v.w2, v.tw, v.tid), TypeError,
     "x must have dtype in"),
    ("x of another dtype than the weights", lambda v: moekit.fused_experts(v.x.half(), v.w13, v.w2, v.tw, v.tid),
     TypeError, "x must have the weights' dtype"),
    ("x's H is not the weights'", lambda v: moekit.fused_experts(v.x[:, :32], v.w13, v.w2, v.tw, v.tid), ValueError,
     r"x must have hidden size H=64 \(from w13 \[E, 2I, H\]\)"),
    ("w13 of two dimensions", lambda v: moekit.fused_experts(v.x, v.w13[0], v.w2, v.tw, v.tid), ValueError,
     "w13 must have 3 dimensions"),
    ("w2 of another I", lambda v: moekit.fused_experts(v.x, v.w13, v.w2[..., :5], v.tw, v.tid), ValueError,
     r"w2 must have shape \(4, 64, 32\), got \(4, 64, 5\)"),
    ("w13 with an odd row count", lambda v: moekit.fused_experts(v.x, v.w13[:, :5], v.w2, v.tw, v.tid), ValueError,
     "2I even"),
    ("w13 and w2 in different formats", lambda v: moekit.fused_experts(v.x, v.q13, v.w2, v.tw, v.tid), TypeError,
     "w13 and w2 must share one format, got mxfp4 and dense"),
    ("weights of an unknown type", lambda v: moekit.fused_experts(v.x, "w13", v.w2, v.tw, v.tid), TypeError,
     "expert weights must be torch.Tensor, MXFP4Tensor, NVFP4Tensor or FP8Tensor, got str"),
    ("topk_weights in fp16", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw.half(), v.tid), TypeError,
     r"topk_weights must have dtype in \(float32\)"),
    ("topk_ids in int64", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid.long()), TypeError,
     r"topk_ids must have dtype in \(int32\)"),
    ("topk_ids for fewer tokens", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw[:2], v.tid[:2]),
     ValueError, r"topk_weights and topk_ids must both be \[T=3, k\], got \(2, 2\) and \(2, 2\)"),
    ("topk_weights with another k", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw[:, :1], v.tid),
     ValueError, r"topk_weights and topk_ids must both be \[T=3, k\], got \(3, 1\) and \(3, 2\)"),
    ("an unknown activation", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid, activation="gelu"),
     ValueError, "activation must be one of"),
    ("w13_bias of I columns", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid,
                                                             w13_bias=torch.zeros(E, I, device=v.device)),
     ValueError, r"w13_bias must have shape \(4, 64\), got \(4, 32\)"),
    ("w2_bias of an integer dtype", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid,
                                                                   w2_bias=torch.zeros(E, H, dtype=torch.int64,
                                                                                       device=v.device)),
     TypeError, "w2_bias must have dtype in"),
    ("out of another shape", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid,
                                                            out=torch.empty(T, H + 1, dtype=v.dt, device=v.device)),
     ValueError, r"out must have shape \(3, 64\), got \(3, 65\)"),
    ("out of another dtype", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid,
                                                            out=torch.empty(T, H, dtype=torch.float16,
                                                                            device=v.device)),
     TypeError, "out must have dtype"),
    ("out aliasing x", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid, out=v.x), ValueError,
     "out must not overlap the memory of x"),
    ("out without unit stride in its last dim", lambda v: moekit.fused_experts(
        v.x, v.w13, v.w2, v.tw, v.tid, out=torch.empty(H, T, dtype=v.dt, device=v.device).T),
     ValueError, "out must have unit stride in its last dimension"),
    ("out not contiguous (rows apart)", lambda v: moekit.fused_experts(
        v.x, v.w13, v.w2, v.tw, v.tid, out=torch.empty(T, 2 * H, dtype=v.dt, device=v.device)[:, :H]),
     ValueError, "out must be contiguous"),
    ("an unknown backend", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid, backend="cuda"),
     ValueError, "backend must be 'auto' or one of"),
    ("config of another type", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid, config="fast"),
     TypeError, "config must be a moekit.experts.ExpertsConfig or None, got str"),
    ("an unknown act_quant", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid, act_quant="int8"),
     ValueError, "act_quant must be one of"),
    ("expert_map in int64", lambda v: moekit.fused_experts(v.x, v.w13, v.w2, v.tw, v.tid,
                                                           expert_map=torch.zeros(E, dtype=torch.int64,
                                                                                  device=v.device)),
     TypeError, r"expert_map must have dtype in \(int32\)"),
    ("expert_map past the local experts", lambda v: moekit.fused_experts(
        v.x, v.w13, v.w2, v.tw, v.tid, expert_map=torch.tensor([0, 1, 2, 4], dtype=torch.int32, device=v.device),
        backend=v.backend),
     ValueError, r"expert_map values must be -1 \(expert not on this rank\) or a local expert index in \[0, 4\)"),
    ("expert_map below -1", lambda v: moekit.fused_experts(
        v.x, v.w13, v.w2, v.tw, v.tid, expert_map=torch.tensor([0, 1, -2, 3], dtype=torch.int32, device=v.device),
        backend=v.backend),
     ValueError, r"got values in \[-2, 3\]"),
    ("4-bit weights with x of another H", lambda v: moekit.fused_experts(v.x[:, :32], v.q13, v.q2, v.tw, v.tid,
                                                                         backend=v.backend),
     ValueError, "x must have hidden size H=64"),
    ("NVFP4 w13 with one global scale per row", lambda v: moekit.fused_experts(
        v.x, nvfp4.NVFP4Tensor(v.n13.data, v.n13.scales, torch.ones(E, 2 * I, device=v.device), v.n13.shape),
        quantize_experts(v.w2.float(), "nvfp4"), v.tw, v.tid, backend=v.backend),
     ValueError, r"w13: NVFP4 expert weights take one global scale, or one per expert \(4,\)"),
    ("FP8 activation groups as weights", lambda v: moekit.fused_experts(
        v.x, fp8.quantize_groups(v.w13.float()), quantize_experts(v.w2.float(), "fp8_block"), v.tw, v.tid,
        act_quant="fp8_group"),
     ValueError, "granularity 'group'"),
    ("batched: x of two dimensions", lambda v: moekit.batched_experts(v.x, v.counts, v.w13, v.w2), ValueError,
     "x must have 3 dimensions"),
    ("batched: x for another E", lambda v: moekit.batched_experts(v.xb[:3], v.counts[:3], v.w13, v.w2), ValueError,
     r"x must be \[E=4, M, H\]"),
    ("batched: counts in int64", lambda v: moekit.batched_experts(v.xb, v.counts.long(), v.w13, v.w2), TypeError,
     r"expert_num_tokens must have dtype in \(int32\)"),
    ("batched: counts for another E", lambda v: moekit.batched_experts(v.xb, v.counts[:3], v.w13, v.w2), ValueError,
     r"expert_num_tokens must have shape \(4,\), got \(3,\)"),
    ("batched: out of another shape", lambda v: moekit.batched_experts(
        v.xb, v.counts, v.w13, v.w2, out=torch.empty(E, 4, H, dtype=v.dt, device=v.device)),
     ValueError, r"out must have shape \(4, 5, 64\)"),
]

ROUTER = [
    ("x's H is not the weight's", lambda v: moekit.router_gemm(v.x[:, :32], v.gate), ValueError,
     r"x must have shape \[..., H=64\] \(H from weight \[E, H\]\), got \(3, 32\)"),
    ("x of another dtype", lambda v: moekit.router_gemm(v.x.half(), v.gate), TypeError,
     "x must have the weight's dtype"),
    ("bias for another E", lambda v: moekit.router_gemm(v.x, v.gate, torch.zeros(E + 1, device=v.device)),
     ValueError, r"bias must have shape \(4,\), got \(5,\)"),
    ("weight of three dimensions", lambda v: moekit.router_gemm(v.x, v.gate[None]), ValueError,
     "weight must have 2 dimensions"),
    ("an empty weight", lambda v: moekit.router_gemm(v.x[:, :0], v.gate[:, :0]), ValueError,
     "weight must be a non-empty"),
    ("an unknown tier", lambda v: moekit.router_gemm(v.x, v.gate, tier="fast"), ValueError,
     "tier must be 'auto' or one of"),
    ("an integer out_dtype", lambda v: moekit.router_gemm(v.x, v.gate, out_dtype=torch.int32), TypeError,
     "out_dtype must be one of"),
    ("lora of another type", lambda v: moekit.router_gemm(v.x, v.gate, lora=(1, 2)), TypeError,
     "lora must be a RouterLoRA, got tuple"),
    ("lora for another H", lambda v: moekit.router_gemm(v.x, v.gate, lora=RouterLoRA(
        torch.zeros(4, H + 1, dtype=v.dt, device=v.device), torch.zeros(E, 4, device=v.device))),
     ValueError, r"lora.a must have shape \(4, 64\)"),
    ("lora ranks that disagree", lambda v: RouterLoRA(torch.zeros(4, H), torch.zeros(E, 3)), ValueError,
     r"lora.b must be \[E, r=4\]"),
    ("lora of rank 65", lambda v: RouterLoRA(torch.zeros(65, H), torch.zeros(E, 65)), ValueError,
     r"lora rank must be in \[1, 64\]"),
    ("lora scale NaN (every logit NaN)", lambda v: RouterLoRA(torch.zeros(4, H), torch.zeros(E, 4), float("nan")),
     ValueError, r"lora.scale must be finite, got nan"),
    ("top_k above E", lambda v: moekit.fused_router(v.x, v.gate, top_k=E + 1, method="softmax_topk"), ValueError,
     r"top_k must be in \[1, num_experts=4\], got 5"),
    ("top_k as a float", lambda v: moekit.fused_router(v.x, v.gate, top_k=2.0, method="softmax_topk"), TypeError,
     "top_k must be an int, got float"),
    ("an unknown method", lambda v: moekit.fused_router(v.x, v.gate, top_k=2, method="nope"), ValueError,
     "method must be one of"),
    ("an unknown impl", lambda v: moekit.fused_router(v.x, v.gate, top_k=2, method="softmax_topk", impl="x"),
     ValueError, "impl must be 'auto', 'fused' or 'unfused'"),
    ("an unknown impl with replayed ids", lambda v: moekit.fused_router(
        v.x, v.gate, top_k=2, method="softmax_topk", impl="x", replay_ids=v.tid),
     ValueError, "impl must be 'auto', 'fused' or 'unfused'"),
    ("groups that do not divide E", lambda v: moekit.fused_router(v.x, v.gate, top_k=2, method="sigmoid_grouped",
                                                                  num_groups=3, topk_groups=1),
     ValueError, "num_groups must divide num_experts=4"),
    ("correction_bias for another E", lambda v: moekit.fused_router(
        v.x, v.gate, top_k=2, method="sigmoid_grouped", num_groups=2, topk_groups=1,
        correction_bias=torch.zeros(E + 1, device=v.device)),
     ValueError, r"correction_bias must have shape \(4,\)"),
    ("correction_bias with softmax routing", lambda v: moekit.fused_router(
        v.x, v.gate, top_k=2, method="softmax_topk", correction_bias=torch.zeros(E, device=v.device)),
     ValueError, "apply only to sigmoid_grouped"),
    ("a routed scaling factor with softmax routing (was dropped: weights 1/scaling of the model's)",
     lambda v: moekit.route(torch.randn(T, E, device=v.device), 2, "softmax_topk", scaling=16.0),
     ValueError, "correction_bias, num_groups, topk_groups and scaling apply only to sigmoid_grouped"),
    ("a MoESpec with a scaling factor on softmax routing", lambda v: presets.MoESpec(
        "custom", H, 16, E, 2, "softmax_topk", "silu_and_mul", routed_scaling_factor=16.0),
     ValueError, "apply only to sigmoid_grouped routing, not softmax_topk"),
    ("route: logits of one dimension", lambda v: moekit.route(torch.randn(E, device=v.device), 2, "softmax_topk"),
     ValueError, "logits must have 2 dimensions"),
    ("route: integer logits", lambda v: moekit.route(torch.ones(T, E, dtype=torch.int64, device=v.device), 2,
                                                     "softmax_topk"),
     TypeError, "logits must have dtype in"),
    ("route: top_k 0", lambda v: moekit.route(torch.randn(T, E, device=v.device), 0, "softmax_topk"), ValueError,
     r"top_k must be in \[1, num_experts=4\], got 0"),
    ("route: an unknown impl", lambda v: moekit.route(torch.randn(T, E, device=v.device), 2, "softmax_topk",
                                                      impl="gpu"),
     ValueError, "impl must be 'auto', 'triton' or 'torch'"),
    ("route: an unknown impl with replayed ids", lambda v: moekit.route(
        torch.randn(T, E, device=v.device), 2, "softmax_topk", impl="gpu", replay_ids=v.tid),
     ValueError, "impl must be 'auto', 'triton' or 'torch'"),
    ("router_gemm: x sparse (CSR)", lambda v: moekit.router_gemm(v.x.to_sparse_csr(), v.gate), ValueError,
     r"x must be a dense \(strided\) tensor, got layout torch.sparse_csr"),
    ("route: logits sparse", lambda v: moekit.route(torch.randn(T, E, device=v.device).to_sparse(), 2,
                                                    "softmax_topk"), ValueError, "logits must be a dense"),
    ("GateLinear with a bool for num_experts (bias passed in its place)", lambda v: moekit.GateLinear(H, True),
     TypeError, "num_experts must be an int, got bool"),
    ("GateLinear with a float hidden_size", lambda v: moekit.GateLinear(2.5, E), TypeError,
     "hidden_size must be an int, got float"),
    ("GateLinear of no experts", lambda v: moekit.GateLinear(H, 0), ValueError,
     "hidden_size and num_experts must be >= 1"),
    ("GateLinear on x of another H", lambda v: moekit.GateLinear(H, E, params_dtype=v.dt, device=v.device)(v.x[:, :8]),
     ValueError, "x must have shape"),
    ("GateLinear.set_lora for another H", lambda v: moekit.GateLinear(H, E, params_dtype=v.dt).set_lora(
        torch.zeros(4, H + 1, dtype=v.dt), torch.zeros(E, 4)),
     ValueError, r"lora.a must have shape \(4, 64\)"),
]

LAYER = [
    ("x of another H: [4, 32] for H=64", lambda v: _layer(v)(torch.randn(4, 32, device=v.device).to(v.dt)),
     ValueError, r"x must have the layer's hidden size H=64 in its last dimension, got shape \(4, 32\)"),
    ("x [2, 7] for H=64", lambda v: _layer(v)(torch.randn(2, 7, device=v.device).to(v.dt)), ValueError,
     r"x must have the layer's hidden size H=64 in its last dimension, got shape \(2, 7\)"),
    ("x of another dtype", lambda v: _layer(v)(torch.randn(2, H, device=v.device).half()), TypeError,
     "x must have the layer's dtype"),
    ("an expert_map shorter than the router's experts", lambda v: _with_map(_layer(v), [0, 1, 2, 3, 4, 5]),
     ValueError, r"expert_map must have one entry per expert of the router, shape \(16,\), got \(6,\)"),
    ("an expert_map past the local experts", lambda v: _with_map(_layer(v), list(range(15)) + [16]), ValueError,
     r"local expert index in \[0, 16\)"),
    ("a spec that is not a MoESpec", lambda v: moekit.FusedMoE("qwen3"), TypeError, "spec must be a MoESpec"),
    ("an unknown preset", lambda v: moekit.FusedMoE.from_preset("nope"), ValueError, "unknown preset 'nope'"),
    ("load_weights of an unknown name", lambda v: _layer(v).load_weights(foo=torch.zeros(1)), ValueError,
     "unknown weight 'foo'"),
    ("load_weights of another shape", lambda v: _layer(v).load_weights(w13=torch.zeros(1)), ValueError,
     r"w13 must have shape \(16, 64, 64\), got \(1,\)"),
    ("load_quantized_experts with dense tensors", lambda v: _layer(v).load_quantized_experts(v.w13, v.w2), TypeError,
     "w13 and w2 must both be MXFP4Tensor, NVFP4Tensor or FP8Tensor"),
    ("load_quantized_experts of another E", lambda v: _layer(v).load_quantized_experts(v.q13, v.q2), ValueError,
     r"w13 must have shape \(16, 64, 64\), got \(4, 64, 64\)"),
    ("load_quantized_experts with an unknown act_quant", lambda v: _layer(v).load_quantized_experts(
        *_stacks(_layer(v), "mxfp4"), act_quant="int8"),
     ValueError, "act_quant must be one of"),
    ("MoESpec of hidden size 0", lambda v: moekit.MoESpec("x", 0, 1, 1, 1, "softmax_topk", "silu_and_mul"),
     ValueError, "hidden_size must be >= 1"),
    ("select_backend of a string", lambda v: moekit.select_backend("call"), TypeError,
     "call must be a moekit.backends.ExpertsCall"),
    ("explain of None", lambda v: moekit.explain(None), TypeError, "call must be a moekit.backends.ExpertsCall"),
    ("select_backend of an unknown name", lambda v: moekit.select_backend(
        backends.ExpertsCall.of(v.x, v.w13), "fast"), ValueError, "backend must be 'auto' or one of"),
    ("set_verification('yes')", lambda v: moekit.set_verification("yes"), TypeError,
     "enabled must be True, False or None"),
    ("presets.get of an unknown name", lambda v: presets.get("nope"), ValueError, "known presets"),
    ("ExpertsConfig with block_m 24", lambda v: ExpertsConfig(24, GemmConfig(16, 32), GemmConfig(16, 32)),
     ValueError, "ExpertsConfig.block_m: expected a power of two, got 24"),
    ("ExpertsConfig with block_m 8", lambda v: ExpertsConfig(8, GemmConfig(16, 32), GemmConfig(16, 32)),
     ValueError, "block_m: expected a power of two >= 16"),
    ("GemmConfig with block_k 48", lambda v: GemmConfig(16, 48), ValueError,
     "GemmConfig.block_k: expected a power of two, got 48"),
    ("GemmConfig with num_stages 0", lambda v: GemmConfig(16, 32, num_stages=0), ValueError,
     r"GemmConfig.num_stages: expected an int >= 1"),
    ("ExpertsConfig with a dict for gemm2", lambda v: ExpertsConfig(16, GemmConfig(16, 32), {"block_n": 16}),
     TypeError, "ExpertsConfig.gemm2 must be a GemmConfig"),
]

LAYOUTS_AND_REFERENCE = [
    ("interleave of an odd row count", lambda v: layouts.interleave(torch.zeros(E, 5, H)), ValueError,
     "w13 must have an even number of rows"),
    ("from_hf with down_proj of another I", lambda v: layouts.from_hf(torch.zeros(E, H, 2 * I),
                                                                      torch.zeros(E, I + 1, H)),
     ValueError, r"down_proj must have shape \(4, 32, 64\)"),
    ("pack_batched with ids for fewer tokens", lambda v: layouts.pack_batched(v.x, v.tid[:2], E, 4), ValueError,
     "topk_ids must have 3 rows"),
    ("pack_batched with a negative capacity", lambda v: layouts.pack_batched(v.x, v.tid, E, -1), ValueError,
     "max_tokens must be an int >= 0, got -1"),
    ("pack_batched with float ids", lambda v: layouts.pack_batched(v.x, v.tw, E, 4), TypeError,
     "topk_ids must have dtype in"),
    ("combine_batched with weights of another k", lambda v: layouts.combine_batched(
        torch.zeros(E, 4, H), torch.zeros(T, K, dtype=torch.long), torch.zeros(T, 1)),
     ValueError, r"topk_weights must have shape \(3, 2\)"),
    ("reference.fused_experts with w2 of another I", lambda v: reference.fused_experts(
        v.x, v.w13, v.w2[..., :3], v.tw, v.tid), ValueError, r"do not fit \(expected w2 \(4, 64, 32\)"),
    ("reference.route with top_k above E", lambda v: reference.route(torch.randn(T, E), 9, "softmax_topk"),
     ValueError, r"top_k must be an int in \[1, E=4\], got 9"),
    ("reference.batched_experts with counts for another E", lambda v: reference.batched_experts(
        v.xb, v.counts[:2], v.w13, v.w2), ValueError, r"expert_num_tokens must have shape \(4,\)"),
]


INTEGRATIONS = [
    ("patch of a string", lambda v: _transformers().patch("model"), TypeError,
     "model must be a torch.nn.Module .a transformers model., got str"),
    ("patch to an integer dtype", lambda v: _transformers().patch(torch.nn.Linear(2, 2), dtype=torch.int8), TypeError,
     "dtype must be None or a floating torch.dtype"),
    ("unpatch of a string", lambda v: _transformers().unpatch("model"), TypeError, "model must be a torch.nn.Module"),
    ("shard_layer with rank past the world", lambda v: _distributed().shard_layer(_layer(v), 5, 2), ValueError,
     r"rank must be in \[0, world_size\) with world_size >= 1, got rank=5, world_size=2"),
    ("shard_layer over no ranks", lambda v: _distributed().shard_layer(_layer(v), 0, 0), ValueError,
     "rank must be in"),
    ("shard_layer of a string", lambda v: _distributed().shard_layer("layer", 0, 2), TypeError,
     "layer must be a FusedMoE, got str"),
    ("shard_layer over a world that does not divide E", lambda v: _distributed().shard_layer(_layer(v), 0, 3),
     ValueError, "num_experts=16 must be divisible by world_size=3"),
    ("ExpertParallelMoE of an unknown mode", lambda v: _distributed().ExpertParallelMoE(
        _distributed().shard_layer(_layer(v), 0, 2), mode="ring"), ValueError, "mode must be one of"),
    ("ExpertParallelMoE of an unsharded layer", lambda v: _distributed().ExpertParallelMoE(_layer(v)), ValueError,
     "local must hold a shard of the experts with its expert_map"),
    ("load_gpt_oss_layer of layer 'a'", lambda v: _gpt_oss().load_gpt_oss_layer("/nonexistent", "a"), ValueError,
     "layer_index must be an int >= 0, got 'a'"),
]


def _transformers():
    from moekit.integrations import transformers

    return transformers


def _distributed():
    from moekit import distributed

    return distributed


def _gpt_oss():
    from moekit.integrations import gpt_oss

    return gpt_oss


def _t(shape, fill=0, dtype=torch.uint8):
    return torch.full(shape, fill, dtype=dtype)


_MX = mxfp4.quantize(torch.randn(4, 64))
_NV = nvfp4.quantize(torch.randn(3, 8, 64), scale_dims=1)
_F8 = fp8.quantize_blocks(torch.randn(4, 256, 256))
def _nan_at(E, N, K):
    w = torch.randn(E, N, K)
    w[1, 0, 0] = float("nan")
    return w


FORMATS = [
    # The six hand-built MXFP4/NVFP4 tensors that gave wrong numbers or crashed the kernels:
    ("MXFP4 scales [4, 1] where [4, 2] belong", lambda v: mxfp4.MXFP4Tensor(_MX.data, _MX.scales[:, :1], _MX.shape),
     ValueError, r"MXFP4Tensor.scales must have shape \(4, 2\), got \(4, 1\)"),
    ("MXFP4 empty scales", lambda v: mxfp4.MXFP4Tensor(_MX.data, _t((0,)), _MX.shape), ValueError,
     r"MXFP4Tensor.scales must have shape \(4, 2\), got \(0,\)"),
    ("MXFP4 data for half the shape", lambda v: mxfp4.MXFP4Tensor(_MX.data[:, :8], _MX.scales, _MX.shape), ValueError,
     r"MXFP4Tensor.data must have shape \(4, 32\), got \(4, 8\)"),
    ("NVFP4 scales for another K", lambda v: nvfp4.NVFP4Tensor(_NV.data, _NV.scales[..., :2], _NV.global_scale,
                                                               _NV.shape),
     ValueError, r"NVFP4Tensor.scales must have shape \(3, 8, 4\)"),
    ("NVFP4 empty scales", lambda v: nvfp4.NVFP4Tensor(_NV.data, _t((0,)).view(torch.float8_e4m3fn),
                                                       _NV.global_scale, _NV.shape),
     ValueError, r"NVFP4Tensor.scales must have shape \(3, 8, 4\), got \(0,\)"),
    ("NVFP4 global scales for another E", lambda v: nvfp4.NVFP4Tensor(_NV.data, _NV.scales, _NV.global_scale[:2],
                                                                      _NV.shape),
     ValueError, "NVFP4Tensor.global_scale must be a scalar or broadcast over the leading dims"),
    # the expert-stack quantizer names its own argument, not the per-expert routine's
    ("quantize_experts of K not a multiple of 32", lambda v: quantize_experts(torch.randn(2, 8, 40), "mxfp4"),
     ValueError, "w must have a last dimension that is a multiple of 32, got shape \\(2, 8, 40\\)"),
    ("quantize_experts of int codes", lambda v: quantize_experts(torch.ones(2, 8, 32, dtype=torch.int32), "nvfp4"),
     TypeError, "w must have dtype in"),
    ("quantize_experts of a list", lambda v: quantize_experts([[[1.0] * 32]], "mxfp4"), TypeError,
     "w must be a torch.Tensor, got list"),
    ("quantize_experts of no experts", lambda v: quantize_experts(torch.zeros(0, 8, 64), "nvfp4"), ValueError,
     r"w must be a non-empty expert stack \[E, N, K\], got shape \(0, 8, 64\)"),
    ("quantize_experts of K = 0", lambda v: quantize_experts(torch.zeros(2, 8, 0), "fp8_channel"), ValueError,
     "w must be a non-empty expert stack"),
    ("quantize_experts of a NaN weight (MXFP4 made it finite)", lambda v: quantize_experts(_nan_at(2, 8, 64), "mxfp4"),
     ValueError, r"w\[1\] holds NaN or Inf"),
    ("float64 past float32's range (became Inf, then NaN)",
     lambda v: nvfp4.quantize(torch.tensor([[1e300] + [0.0] * 31], dtype=torch.float64)), ValueError,
     "x holds values beyond float32's range"),
    ("NVFP4 global scale of 0 (NaN weights)", lambda v: nvfp4.quantize(torch.randn(2, 32), global_scale=0.0),
     ValueError, "global_scale must be finite and > 0"),
    ("NVFP4 global scale of NaN", lambda v: nvfp4.quantize(torch.randn(2, 32), global_scale=float("nan")),
     ValueError, "global_scale must be finite and > 0"),
    ("FP8 tensor scale of more dims than the data (broadcast the data up)",
     lambda v: fp8.FP8Tensor(torch.zeros(3, 8, 32).to(torch.float8_e4m3fn), torch.ones(1, 1, 1, 1), "tensor"),
     ValueError, "FP8Tensor.scale of granularity 'tensor' must hold one value"),
    ("combine_batched of float slots", lambda v: layouts.combine_batched(torch.zeros(2, 3, 4), torch.zeros(5, 2),
                                                                       torch.zeros(5, 2)),
     TypeError, "slot must have dtype in"),
    # and the rest of each type's invariants
    ("MXFP4 data as float", lambda v: mxfp4.MXFP4Tensor(_MX.data.float(), _MX.scales, _MX.shape), TypeError,
     "MXFP4Tensor.data must have dtype uint8, got float32"),
    ("MXFP4 scales as e8m0", lambda v: mxfp4.MXFP4Tensor(_MX.data, _MX.scales_e8m0(), _MX.shape), TypeError,
     "MXFP4Tensor.scales must have dtype uint8"),
    ("MXFP4 K not a multiple of 32", lambda v: mxfp4.MXFP4Tensor(_MX.data, _MX.scales, (4, 60)), ValueError,
     "MXFP4Tensor.shape must end in a multiple of 32"),
    ("MXFP4 of a negative shape", lambda v: mxfp4.MXFP4Tensor(_MX.data, _MX.scales, (-4, 64)), ValueError,
     "MXFP4Tensor.shape must be a non-empty tuple of non-negative ints"),
    ("NVFP4 scales as uint8 without swizzled", lambda v: nvfp4.NVFP4Tensor(_NV.data, _NV.scales.view(torch.uint8),
                                                                           _NV.global_scale, _NV.shape),
     TypeError, "NVFP4Tensor.scales must have dtype float8_e4m3fn"),
    ("NVFP4 swizzled flag on linear scales", lambda v: nvfp4.NVFP4Tensor(_NV.data, _NV.scales, _NV.global_scale,
                                                                         _NV.shape, swizzled=True),
     TypeError, "NVFP4Tensor.scales must have dtype uint8"),
    ("NVFP4 global scale of full rank, one per column", lambda v: nvfp4.NVFP4Tensor(
        _NV.data, _NV.scales, torch.ones(3, 8, 64), _NV.shape), ValueError,
     "NVFP4Tensor.global_scale must be a scalar or broadcast over the leading dims"),
    ("NVFP4 global scale in bf16", lambda v: nvfp4.NVFP4Tensor(_NV.data, _NV.scales, _NV.global_scale.bfloat16(),
                                                               _NV.shape),
     TypeError, "NVFP4Tensor.global_scale must have dtype float32"),
    ("FP8 block scales of another shape", lambda v: fp8.FP8Tensor(_F8.data, _F8.scale[:, :1], "block"), ValueError,
     r"FP8Tensor.scale of granularity 'block' must have shape \(4, 2, 2\) for data \(4, 256, 256\), got \(4, 1, 2\)"),
    ("FP8 of an unknown granularity", lambda v: fp8.FP8Tensor(_F8.data, _F8.scale, "blocks"), ValueError,
     "FP8Tensor.granularity must be one of"),
    ("FP8 per-tensor scales for another E", lambda v: fp8.FP8Tensor(_F8.data, torch.ones(3), "tensor"), ValueError,
     r"must hold one value, or one per expert \(4,\)"),
    ("FP8 data in bf16", lambda v: fp8.FP8Tensor(_F8.data.bfloat16(), _F8.scale, "block"), TypeError,
     "FP8Tensor.data must have dtype float8_e4m3fn"),
    ("mxfp4.dequantize of a tensor", lambda v: mxfp4.dequantize(_MX.data), TypeError,
     "t must be a MXFP4Tensor, got Tensor"),
    ("nvfp4.dequantize to an integer dtype", lambda v: nvfp4.dequantize(_NV, torch.int32), TypeError,
     "dtype must be a floating torch.dtype"),
    ("fp8.dequantize of a tensor", lambda v: fp8.dequantize(torch.zeros(3)), TypeError, "t must be a FP8Tensor"),
    ("formats.dequantize of a string", lambda v: dequantize("w"), TypeError, "cannot dequantize a str"),
    ("formats.expert past the stack", lambda v: expert(quantize_experts(torch.randn(3, 8, 32), "mxfp4"), 3),
     ValueError, r"e must be an expert index in \[0, 3\)"),
    ("quantize_experts of an unknown format", lambda v: quantize_experts(torch.randn(3, 8, 32), "int4"), ValueError,
     "weight_format must be one of"),
    ("quantize_experts of a matrix", lambda v: quantize_experts(torch.randn(8, 32), "mxfp4"), ValueError,
     r"w must be a non-empty expert stack \[E, N, K\]"),
    ("mxfp4.quantize with K=30", lambda v: mxfp4.quantize(torch.randn(4, 30)), ValueError, "multiple of 32"),
    ("mxfp4.quantize of NaN", lambda v: mxfp4.quantize(torch.full((1, 32), float("nan"))), ValueError, "NaN or Inf"),
    ("mxfp4.from_gpt_oss with 8-byte blocks", lambda v: mxfp4.from_gpt_oss(_t((4, 2, 8)), _t((4, 2))), ValueError,
     r"blocks must be \[..., K/32, 16\]"),
    ("nvfp4.quantize with a global scale for 3 rows of 4", lambda v: nvfp4.quantize(torch.randn(4, 32),
                                                                                   global_scale=torch.ones(3)),
     ValueError, "global_scale must be a scalar or have the leading shape"),
    ("nvfp4.unswizzle of 100 bytes", lambda v: nvfp4.unswizzle(_t((100,)), 4, 2), ValueError,
     "swizzled must have 512 bytes"),
    ("nvfp4.from_modelopt with scales for another K", lambda v: nvfp4.from_modelopt(
        _t((4, 16)), _t((4, 1)).view(torch.float8_e4m3fn), torch.ones(())),
     ValueError, r"weight_scale must have shape \(4, 2\)"),
    ("fp4.pack of an odd count", lambda v: fp4.pack(_t((3,))), ValueError, "codes must have an even last dimension"),
    ("fp4.pack of floats", lambda v: fp4.pack(torch.zeros(4)), TypeError, "codes must have dtype in"),
    ("fp8.quantize_blocks of a vector", lambda v: fp8.quantize_blocks(torch.randn(128)), ValueError,
     r"w must be \[..., N, K\]"),
]


def _layer(v):
    return moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=v.dt, device=v.device, scaled=True)


def _stacks(layer, fmt):
    return quantize_experts(layer.w13.detach().float(), fmt), quantize_experts(layer.w2.detach().float(), fmt)


def _with_map(layer, values):
    layer.expert_map = torch.tensor(values, dtype=torch.int32, device=layer.w13.device)
    return layer(torch.randn(2, layer.spec.hidden_size, device=layer.w13.device).to(layer.w13.dtype))


def _check(v, call, error, match):
    with pytest.raises(error, match=match):
        call(v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("why,call,error,match", EXPERTS + ROUTER + LAYER, ids=[c[0] for c in EXPERTS + ROUTER + LAYER])
def test_ops_refuse_bad_input(device, why, call, error, match):
    _check(_valid(device), call, error, match)


@pytest.mark.parametrize("why,call,error,match", LAYOUTS_AND_REFERENCE + FORMATS + INTEGRATIONS,
                         ids=[c[0] for c in LAYOUTS_AND_REFERENCE + FORMATS + INTEGRATIONS])
def test_host_routines_refuse_bad_input(why, call, error, match):
    _check(_valid("cpu"), call, error, match)


def test_meta_tensors_with_an_expert_map_give_meta_output():
    # shape propagation (model init on "meta"): the map's values cannot be read and are not
    m = {"device": "meta"}
    got = moekit.fused_experts(torch.empty(T, H, **m), torch.empty(E, 2 * I, H, **m), torch.empty(E, H, I, **m),
                               torch.empty(T, K, **m), torch.empty(T, K, dtype=torch.int32, **m),
                               expert_map=torch.empty(E, dtype=torch.int32, **m))
    assert got.is_meta and got.shape == (T, H)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_negation_views_are_refused_not_read_as_stored(backend):
    # z.conj().imag and torch._neg_view carry a lazy sign flip that the Triton kernels, reading memory as stored,
    # would lose (router logits off by tens, other experts picked); out= with it would store unflipped values
    z = torch.complex(torch.randn(T, H), torch.randn(T, H))
    neg = z.conj().imag
    w = torch.randn(E, H)
    tier = "triton" if backend == "triton" else "torch"
    with pytest.raises(ValueError, match="x is a view with torch's lazy negation"):
        moekit.router_gemm(neg, w, tier=tier)
    with pytest.raises(ValueError, match="logits is a view with torch's lazy negation"):
        moekit.route(neg[:, :E], K, "softmax_topk", impl=backend)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    tw, tid = torch.softmax(torch.randn(T, K), -1), torch.randint(0, E, (T, K), dtype=torch.int32)
    with pytest.raises(ValueError, match="x is a view with torch's lazy negation"):
        moekit.experts.fused_experts(neg, w13, w2, tw, tid, backend=backend)
    with pytest.raises(ValueError, match="out is a view with torch's lazy negation"):
        moekit.experts.fused_experts(torch.randn(T, H), w13, w2, tw, tid, backend=backend,
                                     out=torch._neg_view(torch.zeros(T, H)))
    # after a call of the same shapes and strides (its checks cached), the view is refused too
    x = torch.randn(T, H)
    moekit.router_gemm(x, w, tier=tier)
    with pytest.raises(ValueError, match="lazy negation"):
        moekit.router_gemm(torch._neg_view(x), w, tier=tier)
