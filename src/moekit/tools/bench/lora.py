"""Expert LoRA benchmark (GPU, CUDA graphs): what rank-16 adapters on w13 and w2 add to a fused_experts call, one
adapter on every token and four adapters mixed over the tokens (issue 30, part 2: at most +15% / +25% at
T <= 256), with PEFT on transformers' experts module (``LoraConfig(target_parameters=...)``) measured beside it
in the same run: its grouped_mm forward without and with the adapter, and the same PEFT module served by moekit's
transformers backend (``experts_implementation="moekit"``). PEFT has no mixed-adapter batches on expert parameters
(its ParamWrapper refuses ``adapter_names``): its four-adapter rows are empty.

Each row also gives how far moekit's output with the PEFT adapter (converted, moekit.integrations.peft) is from
PEFT's own (relative Frobenius), so that both columns time the same computation.

    python benchmarks/bench_lora.py --out benchmarks/results          (writes lora.json / lora.md)

A peer that is not installed or fails is one line in the log and an empty cell; the run goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path

import torch
from torch import nn

from ... import presets
from ...experts import ExpertsLoRA, fused_experts
from ...metrics import rel_errors
from .experts import Layer, _gen, module_available, reseed, routes, time_impl
from .timing import environment, kernel_times_us

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b"]
TOKENS = [1, 16, 256, 4096]
RANK = 16
ADAPTERS = [1, 4]
ROUNDS = 3  # moekit without and with adapters, timed in turns
TARGET = {1: 0.15, 4: 0.25}  # the budget on the extra time at T <= TARGET_MAX_T
TARGET_MAX_T = 256
LAYERS = 2  # decode graphs cycle over this many layers' weights (8 calls per graph), so none stays in L2


def random_lora(spec, n: int, r: int) -> ExpertsLoRA:
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    g = _gen("cuda")
    rnd = lambda *shape, std: torch.randn(*shape, device="cuda", generator=g).mul_(std).bfloat16()  # noqa: E731
    return ExpertsLoRA(rnd(n, E, r, H, std=H ** -0.5), rnd(n, E, 2 * I, r, std=r ** -0.5),
                       rnd(n, E, r, I, std=I ** -0.5), rnd(n, E, H, r, std=r ** -0.5), [2.0] * n)


def lora_ids(T: int, n: int) -> torch.Tensor:
    """One adapter: every token's is 0. Several: each token draws one (mixed in every block of rows)."""
    if n == 1:
        return torch.zeros(T, dtype=torch.int32, device="cuda")
    return torch.randint(0, n, (T,), device="cuda", generator=_gen("cuda"), dtype=torch.int32)


class _Holder(nn.Module):
    """What PEFT injects into: the experts module as ``experts``."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts


def peft_experts(layer: Layer, r: int):
    """(PEFT-wrapped transformers experts module over the layer's weights with one rank-r adapter whose B is random
    (PEFT's zeros would time nothing), the wrapped module's container)."""
    import peft

    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=[],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"], init_lora_weights=False)
    holder = peft.inject_adapter_in_model(config, _Holder(layer.hf), adapter_name="bench")
    g = _gen(layer.w13.device.type)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, device=p.device, generator=g) * (p.shape[-1] ** -0.5))
    return holder


def run(args, log=print) -> list[dict]:
    records = []
    for name in args.presets:
        spec = presets.get(name)
        reseed(name)
        try:
            layers = [Layer(spec, ["hf_grouped_mm"]) for _ in range(LAYERS)]
        except Exception as exc:  # noqa: BLE001 - no transformers: moekit alone
            log(f"transformers' experts module for {name}: {type(exc).__name__}: {exc}; PEFT columns empty")
            layers = [Layer(spec, []) for _ in range(LAYERS)]
        adapters = {n: random_lora(spec, n, args.rank) for n in args.adapters}
        holders = _peft_holders(layers, args.rank, log)
        for T in args.tokens:
            calls = 8 if T <= 64 else 1
            reseed(f"{name} T={T}")
            cases = []
            for i in range(calls):
                tw, tid = routes(spec, T)
                x = torch.randn(T, spec.hidden_size, device="cuda", generator=_gen("cuda")).bfloat16()
                cases.append((x, i % (LAYERS if calls > 1 else 1), tw, tid))
            for n in args.adapters:
                ids = [lora_ids(T, n) for _ in cases]
                rec = {"preset": name, "T": T, "adapters": n, "rank": args.rank}
                rec.update(_moekit(spec, layers, cases, adapters[n], ids, log))
                if n == 1 and holders:
                    rec.update(_peft(spec, layers, holders, cases, log))
                if rec.get("moekit_us") and rec.get("moekit_lora_us"):
                    rec["overhead"] = rec["moekit_lora_us"] / rec["moekit_us"] - 1
                    if T <= TARGET_MAX_T:
                        rec["meets_target"] = rec["overhead"] <= TARGET.get(n, TARGET[max(TARGET)])
                records.append(rec)
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()))
        del layers, holders, adapters
        torch.cuda.empty_cache()
    return records


def _peft_holders(layers, r, log) -> list:
    if not module_available("peft"):
        log("skipping PEFT: peft is not installed (pip install peft)")
        return []
    if any(layer.hf is None for layer in layers):
        return []
    try:
        return [peft_experts(layer, r) for layer in layers]
    except Exception as exc:  # noqa: BLE001
        log(f"PEFT failed to wrap the experts: {_line(exc)}")
        return []


def _timed(label, fn_of_case, cases, log, name="graphable"):
    """(us per call, how it was timed) or (None, why) on failure: a failing peer is one line."""
    try:
        with torch.no_grad():
            us, mode = time_impl(name, fn_of_case, cases)
        return us, mode
    except Exception as exc:  # noqa: BLE001 - one line, the run goes on
        torch.cuda.synchronize()
        log(f"  {label} failed: {_line(exc)}")
        return None, _line(exc)


def _moekit(spec, layers, cases, lora, ids, log) -> dict:
    act = spec.activation

    def base(x, li, tw, tid):
        L = layers[li]
        return fused_experts(x, L.w13, L.w2, tw, tid, activation=act, w13_bias=L.b13, w2_bias=L.b2)

    lora_cases = [(*c, i) for c, i in zip(cases, ids)]

    def with_lora(x, li, tw, tid, lid):
        L = layers[li]
        return fused_experts(x, L.w13, L.w2, tw, tid, activation=act, w13_bias=L.b13, w2_bias=L.b2, lora=lora,
                             lora_ids=lid)

    # The call without and with adapters timed in turns, ROUNDS times each, medians: the overhead is their ratio,
    # and a GPU's clocks drift between two graphs timed once each (gpt-oss-120b T=1's base read 86.1 and 100.3 us in
    # two rows of one run, 2026-12-06)
    runs = {"moekit": ("moekit", base, cases), "moekit_lora": ("moekit + LoRA", with_lora, lora_cases)}
    times, out = {key: [] for key in runs}, {}
    for _ in range(ROUNDS):
        for key, (label, fn, args) in runs.items():
            us, out[f"{key}_mode"] = _timed(label, fn, args, log)
            if us is None:  # a failure: said once; what ran keeps its time
                return out | {f"{k}_us": statistics.median(t) if t and k != key else None for k, t in times.items()}
            times[key].append(us)
    return out | {f"{key}_us": statistics.median(t) for key, t in times.items()}


def _peft(spec, layers, holders, cases, log) -> dict:
    """PEFT's experts (grouped_mm) without and with its adapter, the same module served by moekit, and moekit's
    fused_experts with the converted adapter checked against PEFT's output."""
    from ...integrations import peft as moekit_peft
    from ...integrations.transformers import NAME  # registers moekit with transformers

    out = {}

    def run_with(kind, enabled):
        def call(x, li, tw, tid):
            wrapper = holders[li].experts
            layers[li].hf.config._experts_implementation = kind
            if enabled:
                return wrapper(x, tid.long(), tw.to(x.dtype))
            return moekit_peft.unwrap(wrapper)[0](x, tid.long(), tw.to(x.dtype))
        return call

    out["peft_base_us"], out["peft_base_mode"] = _timed("transformers grouped_mm", run_with("grouped_mm", False),
                                                        cases, log)
    out["peft_lora_us"], out["peft_lora_mode"] = _timed("PEFT grouped_mm + LoRA", run_with("grouped_mm", True),
                                                        cases, log)
    out["peft_moekit_us"], out["peft_moekit_mode"] = _timed("PEFT served by moekit", run_with(NAME, True), cases, log)
    if out.get("peft_base_us") and out.get("peft_lora_us"):
        out["peft_overhead"] = out["peft_lora_us"] / out["peft_base_us"] - 1
    try:  # the same adapter, converted: both columns compute the same thing
        x, li, tw, tid = cases[0]
        lora = moekit_peft.experts_lora(holders[li].experts)
        L = layers[li]
        with torch.no_grad():
            got = fused_experts(x, L.w13, L.w2, tw, tid, activation=spec.activation, w13_bias=L.b13, w2_bias=L.b2,
                                lora=lora, lora_ids=torch.zeros(x.shape[0], dtype=torch.int32, device=x.device))
            ref = run_with("grouped_mm", True)(x, li, tw, tid)
        out["vs_peft_rms_rel"] = rel_errors(got, ref)[1]
    except Exception as exc:  # noqa: BLE001
        log(f"  comparison with PEFT failed: {_line(exc)}")
    return out


def _line(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def markdown(records: list[dict], env: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{100 * v:+.0f}%"  # noqa: E731
    lines = [f"# Expert LoRA ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16, rank {records[0]['rank'] if records else RANK}, "
             "uniform random routing, CUDA-graph replay (eager where a call cannot be captured: the mode columns); "
             f"moekit without and with adapters timed in turns, {ROUNDS} times each, medians. "
             f"Target: at most +{100 * TARGET[1]:.0f}% (one adapter) / +{100 * TARGET[4]:.0f}% (four mixed) at "
             f"T <= {TARGET_MAX_T}. PEFT: LoraConfig(target_parameters=[gate_up_proj, down_proj]) on transformers' "
             "experts module, grouped_mm; 'PEFT via moekit' is that PEFT module with experts_implementation='moekit'.",
             "", "| preset | T | adapters | moekit us | + LoRA us | overhead | target | PEFT grouped_mm us | "
             "PEFT + LoRA us | PEFT overhead | PEFT via moekit us | vs PEFT (rms rel) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        target = {True: "met", False: "missed"}.get(r.get("meets_target"), "-")
        vs = f"{r['vs_peft_rms_rel']:.1e}" if r.get("vs_peft_rms_rel") is not None else "-"
        lines.append(f"| {r['preset']} | {r['T']} | {r['adapters']} | {fmt(r.get('moekit_us'))} | "
                     f"{fmt(r.get('moekit_lora_us'))} | {pct(r.get('overhead'))} | {target} | "
                     f"{fmt(r.get('peft_base_us'))} | {fmt(r.get('peft_lora_us'))} | {pct(r.get('peft_overhead'))} | "
                     f"{fmt(r.get('peft_moekit_us'))} | {vs} |")
    modes = sorted({f"{k}={v}" for r in records for k, v in r.items() if k.endswith("_mode") and v != "graph"})
    if modes:
        lines += ["", "Not timed in a graph: " + ", ".join(modes)]
    return "\n".join(lines) + "\n"


def kernel_profile(args, calls: int = 10) -> str:
    """Device time per kernel (torch.profiler, mean over ``calls``) of fused_experts without and with
    ``args.adapters[0]`` adapters of rank ``args.rank``, per preset and token count: where LoRA's extra time goes."""
    from ... import FusedMoE

    lines = []
    for name in args.presets:
        spec = presets.get(name)
        torch.manual_seed(0)
        layer = FusedMoE(spec, dtype=torch.bfloat16, device="cuda")
        n = args.adapters[0]
        lora = random_lora(spec, n, args.rank)
        for T in args.tokens:
            x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                tw, tid = layer.route(x)
            ids = lora_ids(T, n)
            kw = dict(activation=spec.activation, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
            cases = {"base": lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, **kw),
                     f"+{n} adapter(s)": lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, lora=lora,
                                                               lora_ids=ids, **kw)}
            for label, fn in cases.items():
                lines += [f"{name} T={T} {label}: {us:8.1f} us  x{count}  {kernel[:80]}"
                          for kernel, us, count in kernel_times_us(fn, calls)]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", "--presets", dest="presets", nargs="+", default=PRESETS, choices=presets.names())
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--adapters", nargs="+", type=int, default=ADAPTERS)
    p.add_argument("--rank", type=int, default=RANK)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--profile", action="store_true",
                   help="print the device time per kernel with and without adapters (first --adapters value) and stop")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (its timings are CUDA-graph replays)")
    if any(t < 1 for t in args.tokens) or any(n < 1 for n in args.adapters) or args.rank < 1:
        p.error("token counts, adapter counts and the rank must be >= 1")
    if args.profile:
        print(kernel_profile(args))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    try:
        records = run(args)
    except Exception:  # a crash still writes what was measured
        traceback.print_exc()
    env = environment()
    versions = {m: _version(m) for m in ("transformers", "peft")}
    (args.out / "lora.json").write_text(json.dumps({"env": env, "versions": versions, "records": records}, indent=1))
    md = markdown(records, env)
    (args.out / "lora.md").write_text(md)
    print(md)


def _version(module: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
