"""Does the experts gate (MOEKIT_VERIFY=1) pass the Triton backend on real preset shapes? One fused_experts call per
preset, weight format and token count (T = 1..4096, each a kernel variant of its own), with the gate on: the
verdict the gate stored for the call's class, the check's time, and any warning or error. A false failure here
would take the Triton backend away from every user of the gate. GPU only.

    PYTHONPATH=src python benchmarks/experiments/gate_real_shapes.py OUT_DIR   # writes OUT_DIR/gate_gpu.json
"""
import json
import os
import sys
import time
import warnings

import torch
from moekit import gate, presets
from moekit.experts import fused_experts, backends
from moekit.experts.gate_case import gate_class
from moekit.formats import prepare, quantize_experts

out_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
CASES = [("gpt-oss-120b", "mxfp4"), ("qwen3-30b-a3b", "nvfp4"), ("mixtral-8x7b", "bf16"), ("gpt-oss-20b", "bf16"),
         ("deepseek-v3", "fp8_block")]
TOKENS = [1, 2, 16, 17, 64, 256, 4096]
rows = []
gate.set_verification(True)
for name, fmt in CASES:
    if name not in presets.names():
        print("no preset", name); continue
    spec = presets.get(name)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * I ** -0.5
    aq = None
    if fmt != "bf16":
        w13, w2 = prepare(quantize_experts(w13, fmt)), prepare(quantize_experts(w2, fmt))
        aq = "fp8_group" if fmt.startswith("fp8") else None
    b13 = torch.randn(E, 2 * I, device="cuda", dtype=torch.bfloat16) * 0.1 if spec.expert_bias else None
    b2 = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.1 if spec.expert_bias else None
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:spec.top_k] for _ in range(T)]).int() if T <= 64 else \
            torch.rand(T, E, device="cuda").topk(spec.top_k, dim=1).indices.int()
        tw = torch.rand(T, spec.top_k, device="cuda")
        before = len(gate.results())
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fused_experts(x, w13, w2, tw, ids, activation=spec.activation, w13_bias=b13, w2_bias=b2, act_quant=aq)
                err = None
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        call = backends.ExpertsCall.of(x, w13, aq, activation=spec.activation, w2=w2, top_k=spec.top_k,
                                       biases=(b13 is not None, b2 is not None))
        tri = [b for b in backends.BACKENDS if b.name == "triton"][0]
        cls = gate_class(tri, call)
        verdict = gate.results().get(("triton", cls))
        rec = dict(preset=name, fmt=fmt, T=T, new_checks=len(gate.results()) - before, seconds=round(dt, 3),
                   mode=None if cls.config is None else cls.config.mode,
                   block_m=None if cls.config is None else cls.config.block_m,
                   case=(cls.num_tokens, cls.dims), passed=None if verdict is None else verdict[0],
                   detail=None if verdict is None else verdict[1], warnings=[str(w.message)[:200] for w in caught],
                   error=err)
        rows.append(rec)
        print(f"{name:14s} {fmt:9s} T={T:5d} mode={rec['mode']} bm={rec['block_m']} case={rec['case']} "
              f"new={rec['new_checks']} {dt:6.2f}s passed={rec['passed']} {rec['detail'] or ''} {err or ''}",
              flush=True)
    del w13, w2
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(out_dir, "gate_gpu.json"), "w"), indent=1)
fails = [r for r in rows if r["passed"] is False or r["error"]]
print(f"== {len(rows)} calls, {sum(r['new_checks'] for r in rows)} checks, {len(fails)} failures")
