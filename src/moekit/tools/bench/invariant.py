"""Batch-invariant mode against the default mode (GPU): the same calls timed in both modes in one run, under CUDA
graphs, with each row's measured bitwise invariance (issue 31).

Ops: ``router_gemm`` (fp32 logits), ``fused_router`` (GEMM + top-k: the call FusedMoE.route makes),
``fused_experts`` in bf16 and in the preset's checkpoint format, and the whole ``FusedMoE`` (router, routing,
experts, any shared expert). Per (preset, format, T): each op is timed in the default mode and in batch-invariant
mode (moekit.tools.bench.timing.graph_time_us), and a probe token is run alone and in the middle of the T-token
batch in batch-invariant mode: ``bitwise_invariant`` says whether its outputs had the same bits. Targets: invariant
<= 1.25x default at T <= 16, <= 1.10x at T >= 64.

Where the weights come from, per op: ``fused_experts`` and ``FusedMoE`` time 8 calls, each with its own routing and
input, cycling over 2 layers up to T=64 (one call above): each call reads the experts it hits, which for this
bench's presets is far more than the 50 MB L2 per replay (``replay_bytes`` records fused_experts' distinct (layer,
expert) weights per replay; FusedMoE reads experts of the same layers, chosen by its router). A router's weights
are at most a few MB (E x H bf16), so 2 layers of them stay in L2: ``router_gemm`` and ``fused_router`` cycle over
copies of the layers' router weights instead, one per call, as many as make one replay touch
timing.MIN_REPLAY_BYTES (weights, inputs and logits; twice the L2), at every T. The table marks rows whose replay
touched less as possibly L2-resident.

Writes {out}/{name}.json ({"env": {...}, "records": [{"op", "preset", "format", "T", "default_us", "invariant_us",
"bitwise_invariant", "ratio", "calls", "replay_bytes"}, ...]}, rewritten after every preset so that a long run keeps
what it measured) and {out}/{name}.md.

    python benchmarks/bench_invariant.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from ... import _invariant, presets
from ...experts import fused_experts
from ...formats import prepare, quantize_experts
from ...layer import FusedMoE
from ...routing import fused_router, router_gemm
from . import floors
from .experts import PRESETS, TOKENS, _gen, reseed, routes
from .lowbit import NATIVE
from .timing import MIN_REPLAY_BYTES, calls_past_l2, environment, graph_time_us

OPS = ("router_gemm", "fused_router", "fused_experts", "FusedMoE")
DECODE_MAX, DECODE_TARGET = 16, 1.25  # invariant / default at T <= 16
LARGE_MIN, LARGE_TARGET = 64, 1.10  # and at T >= 64
DECODE_CALLS = 8  # calls per graph up to T = 64, cycling over the layers
ROUTER_OPS = ("router_gemm", "fused_router")  # ops that read a router's weights only: they cycle over copies


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", nargs="+", default=PRESETS, choices=presets.names())
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--formats", nargs="+", default=["bf16", "native"],
                   help="bf16 and/or 'native' (each preset's checkpoint format: gpt-oss MXFP4, qwen3 NVFP4, "
                        "deepseek-v3/kimi-k2 FP8 W8A8; presets without one skip it)")
    p.add_argument("--layers", type=int, default=2, help="layers' weights the decode graphs cycle over")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="invariant")


class _Layer:
    """One layer: a FusedMoE (its router and bf16 experts) and, for a low-bit format, its experts quantized."""

    def __init__(self, spec, recipe: str | None):
        self.moe = FusedMoE(spec, dtype=torch.bfloat16, device="cuda")
        if spec.expert_bias:
            with torch.no_grad():
                self.moe.w13_bias.normal_(std=0.02)
                self.moe.w2_bias.normal_(std=0.02)
        self.recipe = recipe
        self.q13 = self.q2 = None
        if recipe is not None:
            self.q13, self.q2 = (prepare(quantize_experts(self.moe.w13.data, recipe)),  # as FusedMoE keeps them
                                 prepare(quantize_experts(self.moe.w2.data, recipe)))
        self.act_quant = "fp8_group" if recipe and recipe.startswith("fp8") else None


class _Router:
    """A copy of one layer's router weights in memory of its own, with the attributes the router ops read of a
    layer (``moe.gate.weight``, ``moe.gate.bias``, ``moe.correction_bias``)."""

    def __init__(self, moe):
        copy = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        gate = SimpleNamespace(weight=copy(moe.gate.weight), bias=copy(moe.gate.bias))
        self.moe = SimpleNamespace(gate=gate, correction_bias=copy(getattr(moe, "correction_bias", None)))


def router_bytes(spec, T: int) -> int:
    """Bytes one router call moves: bf16 weights [E, H] and input [T, H] read, fp32 logits [T, E] written."""
    return spec.num_experts * spec.hidden_size * 2 + T * spec.hidden_size * 2 + T * spec.num_experts * 4


def router_calls(spec, T: int) -> int:
    """Calls (each on a router copy and input of its own) a router op's graph holds: as the other ops' (8 up to
    T = 64, else 1), and enough that one replay touches MIN_REPLAY_BYTES."""
    return calls_past_l2(router_bytes(spec, T), DECODE_CALLS if T <= LARGE_MIN else 1)


def _op_fn(op: str, fmt: str, spec):
    """fn(layer, x, tw, ids) -> outputs of ``op`` (a tensor or a tuple). The router ops read only
    ``layer.moe``'s gate and correction bias (a layer, or a _Router copy)."""
    act = spec.activation

    def experts(layer, x, tw, ids):
        m = layer.moe
        w13, w2 = (m.w13, m.w2) if fmt == "bf16" else (layer.q13, layer.q2)
        return fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=m.w13_bias, w2_bias=m.w2_bias,
                             act_quant=None if fmt == "bf16" else layer.act_quant)

    def gemm(layer, x, tw, ids):
        return router_gemm(x, layer.moe.gate.weight, layer.moe.gate.bias)

    def router(layer, x, tw, ids):  # FusedMoE.route's call (without adapters)
        m, kwargs = layer.moe, spec.routing_kwargs()
        if getattr(m, "correction_bias", None) is not None:
            kwargs["correction_bias"] = m.correction_bias
        return fused_router(x, m.gate.weight, m.gate.bias, top_k=spec.top_k, method=spec.routing, **kwargs)

    def whole(layer, x, tw, ids):
        return layer.moe(x)

    return {"router_gemm": gemm, "fused_router": router, "fused_experts": experts, "FusedMoE": whole}[op]


def _cases(spec, T, layers, calls: int | None = None):
    """(layer, x [T, H], topk_weights, topk_ids) per call, each with its own routing and input, cycling over
    ``layers``: ``calls`` of them (default 8 up to T = 64, else 1)."""
    calls = calls or (DECODE_CALLS if T <= LARGE_MIN else 1)
    reseed(f"{spec.name} T={T} invariant")
    out = []
    for i in range(calls):
        tw, ids = routes(spec, T)
        x = torch.randn(T, spec.hidden_size, device="cuda", generator=_gen("cuda")).bfloat16()
        out.append((layers[i % len(layers)], x, tw, ids))
    return out


def replay_bytes(op: str, fmt: str, spec, cases) -> float | None:
    """Bytes one replay of ``cases`` reads for ``op``: the router copies' weights, inputs and logits (router ops);
    the distinct (layer, expert) weights the calls hit, as stored (fused_experts); None for FusedMoE (its router
    picks the experts)."""
    if op in ROUTER_OPS:
        return len({id(c[0]) for c in cases}) * router_bytes(spec, cases[0][1].shape[0])
    if op != "fused_experts":
        return None
    layer = cases[0][0]
    m = layer.moe
    w13, w2 = (m.w13, m.w2) if fmt == "bf16" else (layer.q13, layer.q2)
    pairs = {(id(c[0]), e) for c in cases for e in c[3].unique().tolist()}
    return len(pairs) * floors.expert_bytes(spec.num_experts, w13, w2, m.w13_bias, m.w2_bias)


def _same_bits(a, b) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)) for u, v in zip(a, b))


def bitwise_invariant(fn, layer, x, tw, ids) -> bool:
    """A probe token (the batch's middle row) alone against its row in the batch, in batch-invariant mode."""
    pos = x.shape[0] // 2
    with torch.no_grad():
        alone = fn(layer, x[pos:pos + 1].clone(), tw[pos:pos + 1].clone(), ids[pos:pos + 1].clone())
        batch = fn(layer, x, tw, ids)
    row = tuple(o[pos:pos + 1] for o in batch) if isinstance(batch, tuple) else batch[pos:pos + 1]
    return _same_bits(alone, row)


def time_both(fn, cases) -> tuple[float, float]:
    """(default us, invariant us) per call in CUDA graphs: each mode's eager calls, then its capture."""
    times = []
    for on in (False, True):
        _invariant.set_batch_invariant(on)
        calls = [lambda c=c: fn(*c) for c in cases]
        with torch.no_grad():
            calls[0]()  # an eager call of the mode before its capture
            times.append(graph_time_us(calls, replays=20))
    return times[0], times[1]


def run(args, on_record=print) -> list[dict]:
    records = []
    env = environment()
    saved = _invariant._ENABLED
    try:
        for name in args.presets:
            spec = presets.get(name)
            fmts = [("bf16", None)] if "bf16" in args.formats else []
            if "native" in args.formats and name in NATIVE:
                fmts.append((NATIVE[name], NATIVE[name]))
            reseed(f"{name} invariant weights")
            recipe = next((r for _, r in fmts if r), None)
            # deepseek-v3 / kimi-k2: a bf16 layer is 22.5 / 34 GB; two of them and a quantized copy each fit
            layers = [_Layer(spec, recipe) for _ in range(max(1, args.layers))]
            routers = []
            if any(op in ROUTER_OPS for op in args.ops):  # one copy per call of the longest router graph
                routers = [_Router(layers[i % len(layers)].moe)
                           for i in range(max(router_calls(spec, T) for T in args.tokens))]
            for T in args.tokens:
                for fmt, _ in fmts:
                    for op in args.ops:
                        if fmt != "bf16" and op != "fused_experts":
                            continue  # the router and the layer run bf16 (FusedMoE's low-bit layers: fused_experts)
                        if op in ROUTER_OPS:
                            records.append(_measure(op, fmt, spec, T, routers, router_calls(spec, T)))
                        else:
                            records.append(_measure(op, fmt, spec, T, layers))
                        on_record(_line(records[-1]))
            del layers, routers
            torch.cuda.empty_cache()
            save(args, env, records)
    finally:
        _invariant.set_batch_invariant(saved)
    return records


def _measure(op, fmt, spec, T, layers, calls: int | None = None) -> dict:
    rec = {"op": op, "preset": spec.name, "format": fmt, "T": T, "default_us": None, "invariant_us": None,
           "bitwise_invariant": None, "ratio": None}
    fn = _op_fn(op, fmt, spec)
    try:
        cases = _cases(spec, T, layers, calls)
        rec["calls"], rec["replay_bytes"] = len(cases), replay_bytes(op, fmt, spec, cases)
        rec["default_us"], rec["invariant_us"] = time_both(fn, cases)
        rec["ratio"] = rec["invariant_us"] / rec["default_us"]
        _invariant.set_batch_invariant(True)
        rec["bitwise_invariant"] = bitwise_invariant(fn, *cases[0])
    except Exception as exc:  # noqa: BLE001 - one failing row is reported; the run goes on
        torch.cuda.synchronize()
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
    return rec


def _line(r: dict) -> str:
    if r.get("error"):
        return f"{r['preset']} {r['format']} {r['op']} T={r['T']}: ERROR {r['error']}"
    return (f"{r['preset']} {r['format']} {r['op']} T={r['T']}: default {r['default_us']:.1f} us, invariant "
            f"{r['invariant_us']:.1f} us ({r['ratio']:.2f}x), bitwise invariant {r['bitwise_invariant']}")


def target(T: int) -> float | None:
    """The issue's bound on invariant / default at this T (none between 16 and 64)."""
    return DECODE_TARGET if T <= DECODE_MAX else LARGE_TARGET if T >= LARGE_MIN else None


def markdown(env: dict, records: list[dict]) -> str:
    lines = [f"# Batch-invariant mode against the default mode ({env.get('gpu')}, {env.get('date')})", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}; CUDA-graph replay, us per call; ratio = invariant "
             f"/ default; target <= {DECODE_TARGET}x at T <= {DECODE_MAX}, <= {LARGE_TARGET}x at T >= {LARGE_MIN}; "
             "bitwise: a probe token alone and in the batch gave the same bits in batch-invariant mode. "
             "fused_experts and FusedMoE: 8 calls cycling over the layers (--layers, default 2) up to T=64, one above, "
             "each call with its own routing; "
             "router_gemm and fused_router: one copy of a layer's router weights per call, as many as make one "
             f"replay touch {MIN_REPLAY_BYTES / 1e6:.0f} MB (twice the 50 MB L2).", *_l2_words(records), "",
             "| preset | format | op | T | default us | invariant us | ratio | target | bitwise |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['preset']} | {r['format']} | {r['op']} | {r['T']} | - | - | - | - | "
                         f"error: {r['error'][:80]} |")
            continue
        bound = target(r["T"])
        verdict = "-" if bound is None else ("met" if r["ratio"] <= bound else f"**missed** (<= {bound})")
        lines.append(f"| {r['preset']} | {r['format']} | {r['op']} | {r['T']} | {r['default_us']:.1f} | "
                     f"{r['invariant_us']:.1f} | {r['ratio']:.2f} | {verdict} | "
                     f"{'yes' if r['bitwise_invariant'] else '**NO**'} |")
    ok = [r for r in records if not r.get("error")]
    missed = [r for r in ok if target(r["T"]) is not None and r["ratio"] > target(r["T"])]
    lines += ["", f"{len(ok)} rows measured, {len(records) - len(ok)} errors; bitwise invariant in "
                  f"{sum(bool(r['bitwise_invariant']) for r in ok)} of {len(ok)}; speed target missed in "
                  f"{len(missed)}."]
    return "\n".join(lines) + "\n"


def _l2_words(records: list[dict]) -> list[str]:
    """The header's line on rows whose data may have stayed in L2 between replays: a replay that touched less than
    MIN_REPLAY_BYTES, or a router op of a run before the copies (2 layers' router weights, a few MB)."""
    small = [r for r in records if r.get("replay_bytes") is not None and r["replay_bytes"] < MIN_REPLAY_BYTES]
    old = [r for r in records if r["op"] in ROUTER_OPS and "replay_bytes" not in r]
    lines = []
    if small:
        lines.append(f"May be L2-resident (one replay touched under {MIN_REPLAY_BYTES / 1e6:.0f} MB): " + ", ".join(
            f"{r['preset']} {r['format']} {r['op']} T={r['T']} ({r['replay_bytes'] / 1e6:.1f} MB)" for r in small)
            + ".")
    if old:
        lines.append("L2-resident: the router_gemm and fused_router rows without replay_bytes in the JSON (earlier "
                     "runs) cycled over 2 layers' router weights, a few MB: those weights stayed in L2 between "
                     "replays.")
    return lines


def save(args, env: dict, records: list[dict]) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps({"env": env, "records": records}, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(env, records))
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_invariant needs a CUDA GPU (its timings are CUDA-graph replays)")
    records = run(args)
    path = save(args, environment(), records)
    print(markdown(environment(), records))
    print(f"wrote {path} and {path.with_suffix('.md')}")
