"""Eager benchmark (GPU): host time per call of every moekit op against its graph replay, with the plain torch
router chain and Hugging Face's grouped_mm experts as peers, and greedy generation of a small Hugging Face
model with and without moekit.

eager us/call: a loop of ``LOOP`` back-to-back calls on the same inputs, one synchronize at the end, divided by
``LOOP`` (median of ``ROUNDS`` loops): the wall time per call when the GPU is not the bottleneck. host us/call: the
same loops' time until the last call returns, before the synchronize: the host's Python and launch work alone
(equal to eager us/call where the host is the bottleneck, below it where the GPU is). A shared host's speed varies
from run to run (the torch chain, the same code every run, is its yardstick): compare ops within one run.
graph us/call: the same call replayed in a CUDA graph (bench/timing.py). kernels: CUDA kernels one call launches
(torch.profiler). batched_experts runs M = max(1, T*k/E) rows for every one of the E experts (its table label says
E x M rows): another workload than fused_experts' at the same T (at T=1, E experts' weights instead of k).
The results record the transformers version and which experts implementation each generation row ran.

    python benchmarks/bench_eager.py --out benchmarks/results            (writes eager.json / eager.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import FusedMoE, GateLinear, batched_experts, fused_experts, fused_router, presets, route
from .timing import environment, graph_time_us

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b"]
TOKENS = [1, 16, 256]
LOOP = 300
ROUNDS = 5
GRAPH_CALLS = 20
# The budgets on host time per call (us): fused_experts, batched_experts, fused_router, GateLinear, route,
# FusedMoE.forward
HOST_TARGET_US = {"fused_experts": 40, "batched_experts": 40, "fused_router": 20, "GateLinear": 15, "route": 15,
                  "FusedMoE": 60}
OPS = ("fused_experts", "batched_experts", "fused_router", "GateLinear", "route", "FusedMoE", "torch_chain",
       "hf_grouped_mm")


def eager_loop_us(fn, loop: int = LOOP, rounds: int = ROUNDS) -> tuple[float, float]:
    """(wall, host) microseconds per call of ``loop`` back-to-back calls, medians over ``rounds`` loops: wall to
    the synchronize after the loop, host to the loop's last return."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(loop):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / loop * 1e6)
        hosts.append((issued - start) / loop * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def kernels_per_call(fn) -> int:
    """CUDA kernels one call launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def batched_rows(spec, T: int) -> int:
    """Rows per expert of the batched_experts case: M = max(1, T*k/E), every expert's slab full (E*M rows)."""
    return max(1, T * spec.top_k // spec.num_experts)


def op_label(r: dict) -> str:
    """A record's op as the table names it: batched_experts with the rows it runs (E x M)."""
    if r["op"] != "batched_experts":
        return r["op"]
    E, M = r.get("experts"), r.get("rows_per_expert")
    if M is None:  # records before these fields: the same rule from the preset
        spec = presets.get(r["preset"])
        E, M = spec.num_experts, batched_rows(spec, r["T"])
    return f"batched_experts ({E} x {M} rows)"


def cases(spec, T: int) -> dict:
    """op -> a no-argument call on fresh inputs of ``spec`` at ``T`` tokens."""
    dev, dt = "cuda", torch.bfloat16
    E, H, k = spec.num_experts, spec.hidden_size, spec.top_k
    layer = FusedMoE(spec, dtype=dt, device=dev)
    x = torch.randn(T, H, device=dev, dtype=dt)
    with torch.no_grad():
        tw, tid = layer.route(x)
    M = batched_rows(spec, T)
    xb = torch.randn(E, M, H, device=dev, dtype=dt)
    counts = torch.full((E,), M, dtype=torch.int32, device=dev)
    gate = GateLinear(H, E, bias=spec.router_bias, device=dev)
    logits = torch.randn(T, E, device=dev)
    kwargs = spec.routing_kwargs()
    if layer.correction_bias is not None:
        kwargs["correction_bias"] = layer.correction_bias.detach()

    def torch_chain():  # the router it replaces: bf16 logits, softmax, top-k
        probs = torch.softmax(F.linear(x, layer.gate.weight.detach()).float(), dim=-1)
        w, ids = probs.topk(k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    out = {
        "fused_experts": lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, activation=spec.activation,
                                               w13_bias=layer.w13_bias, w2_bias=layer.w2_bias),
        "batched_experts": lambda: batched_experts(xb, counts, layer.w13, layer.w2, activation=spec.activation,
                                                   w13_bias=layer.w13_bias, w2_bias=layer.w2_bias),
        "fused_router": lambda: fused_router(x, layer.gate.weight, layer.gate.bias, top_k=k, method=spec.routing,
                                             **kwargs),
        "GateLinear": lambda: gate(x),
        "route": lambda: route(logits, k, spec.routing, **kwargs),
        "FusedMoE": lambda: layer(x),
        "torch_chain": torch_chain,
    }
    hf = _hf_experts(spec, layer)
    if hf is not None:
        out["hf_grouped_mm"] = lambda: hf(x, tid.long(), tw.to(dt))
    return out


def _hf_experts(spec, layer):
    """transformers' grouped_mm experts of the preset's family over the layer's weights (Qwen3-MoE's module as they
    are; gpt-oss's with its transposed stacks, one copy, and its biases), or None without transformers."""
    from types import SimpleNamespace

    from .experts import _hf_experts as family_module

    parts = SimpleNamespace(w13=layer.w13.detach(), w2=layer.w2.detach(),
                            b13=None if layer.w13_bias is None else layer.w13_bias.detach(),
                            b2=None if layer.w2_bias is None else layer.w2_bias.detach())
    try:
        module = family_module(spec, parts)
    except ImportError:
        return None
    module.config._experts_implementation = "grouped_mm"
    return torch.no_grad()(module)


def run(args) -> list[dict]:
    records = []
    for name in args.presets:
        spec = presets.get(name)
        for T in args.tokens:
            torch.manual_seed(T)
            with torch.no_grad():
                for op, fn in cases(spec, T).items():
                    try:  # many calls per graph: the graph's own launch is not the op's time
                        graph = graph_time_us([fn] * GRAPH_CALLS, replays=20)
                    except Exception as exc:  # noqa: BLE001 - not capturable: say so, time it eagerly only
                        torch.cuda.synchronize()
                        graph, note = None, f"no graph: {type(exc).__name__}"
                    else:
                        note = ""
                    eager, host = eager_loop_us(fn)
                    rec = {"op": op, "preset": name, "T": T, "eager_us": eager, "host_us": host, "graph_us": graph,
                           "kernels": kernels_per_call(fn)}
                    if op == "batched_experts":
                        rec |= {"experts": spec.num_experts, "rows_per_expert": batched_rows(spec, T)}
                    if note:
                        rec["note"] = note
                    records.append(rec)
                    print(rec, flush=True)
        torch.cuda.empty_cache()
    return records


def graph_replay_errors(T: int = 16) -> dict:
    """Whether an experts call is graph-safe: captured on one routing, replayed after new inputs and routes are
    copied into its buffers, against the same call made eagerly on the new inputs (max relative error; 0 is
    bit-equal). qwen3-30b-a3b shapes; moekit's fused_experts and transformers' grouped_mm experts."""
    from ...metrics import rel_errors

    spec, dev, dt = presets.get("qwen3-30b-a3b"), "cuda", torch.bfloat16
    layer = FusedMoE(spec, dtype=dt, device=dev)
    hf = _hf_experts(spec, layer)
    calls = {"moekit fused_experts": lambda x, ids, w: fused_experts(x, layer.w13, layer.w2, w, ids.int())}
    if hf is not None:
        calls["transformers grouped_mm"] = lambda x, ids, w: hf(x, ids, w.to(dt))

    def inputs(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        ids = torch.rand(T, spec.num_experts, device=dev, generator=g).argsort(1)[:, :spec.top_k]
        w = torch.softmax(torch.randn(T, spec.top_k, device=dev, generator=g), -1)
        return torch.randn(T, spec.hidden_size, device=dev, dtype=dt, generator=g), ids, w

    out = {}
    with torch.no_grad():
        for name, fn in calls.items():
            try:
                bufs = inputs(1)
                fn(*bufs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = fn(*bufs)
                new = inputs(2)
                for dst, src in zip(bufs, new):
                    dst.copy_(src)
                graph.replay()
                torch.cuda.synchronize()
                out[name] = rel_errors(y.float(), fn(*new).float())[0]
            except Exception as exc:  # noqa: BLE001 - a capture that fails is the answer
                torch.cuda.synchronize()
                out[name] = f"not capturable: {type(exc).__name__}: {str(exc)[:120]}"
            print(name, out[name], flush=True)
    return out


def profile(args) -> str:
    """cProfile of ``LOOP`` eager calls of each op named in ``args.profile`` (``op:preset:T``), sorted by own and by
    cumulative time: where an eager call's host time goes."""
    import cProfile
    import io
    import pstats

    report = []
    for item in args.profile:
        op, name, T = item.split(":")
        torch.manual_seed(0)
        with torch.no_grad():
            fn = cases(presets.get(name), int(T))[op]
            eager_loop_us(fn, loop=20, rounds=1)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(LOOP):
                fn()
            prof.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        report.append(f"## {item}: {LOOP} calls\n{text.getvalue()}")
    return "\n".join(report)


def generate_tokens_per_s(patched: bool, new_tokens: int = 64) -> tuple[float, str]:
    """(tokens per second, which experts implementation ran) of greedy generation, eager mode, of a Qwen3-MoE model
    at qwen3-30b-a3b's hidden and expert sizes with 2 layers and random weights (no download)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from ...integrations.transformers import patch

    spec = presets.get("qwen3-30b-a3b")
    cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=spec.hidden_size, intermediate_size=6144,
                         moe_intermediate_size=spec.intermediate_size, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, num_experts=spec.num_experts,
                         num_experts_per_tok=spec.top_k)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    experts = experts_implementation(model, patch(model) if patched else None)
    prompt = torch.randint(0, 32000, (1, 16), device="cuda")
    model.generate(prompt, max_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - start), experts


def experts_implementation(model, report=None) -> str:
    """Which experts implementation a generation ran: moekit's blocks (``report``: patch()'s), or the experts
    implementation transformers dispatched to (its config's _experts_implementation; "grouped_mm" by default in
    transformers 5)."""
    if report is not None:
        left = f", {len(report.left_alone)} left alone" if report.left_alone else ""
        return f"moekit patch(): {len(report.replaced)} MoE blocks replaced by MoekitBlock (fused_router + " \
               f"fused_experts){left}"
    impl = getattr(model.config, "_experts_implementation", None)
    return f"transformers experts_implementation={impl!r}" if impl else "transformers' experts module (no " \
        "experts_implementation in this transformers)"


def transformers_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def markdown(records: list[dict], env: dict, generation: dict, replay: dict | None = None,
             generation_experts: dict | None = None) -> str:
    """The table; ``generation``: {model: tokens/s}; ``generation_experts``: {model: the experts implementation it
    ran}; ``replay``: graph_replay_errors()."""
    versions = f"torch {env['torch']}, triton {env['triton']}" + (
        f", transformers {env['transformers']}" if env.get("transformers") else "")
    lines = [f"# Eager host time ({env['gpu']}, {env['date']})", "",
             f"{versions}. eager: {LOOP} back-to-back calls, one synchronize, "
             f"wall time / calls (median of {ROUNDS} loops); host: the same loops until the last call returns (the "
             "host's work alone); graph: the same call replayed in a CUDA graph; target: the host-time budget. "
             "The host's speed varies between runs: the torch chain (the same code in every run) is its yardstick. "
             "batched_experts (E x M rows): M = max(1, T*k/E) rows for every expert, E*M rows in all: not the "
             "workload of fused_experts at the same T (at T=1 it reads all E experts, fused_experts k).",
             "", "| op | preset | T | eager us/call | host us/call | target | graph us/call | eager / graph | "
             "kernels |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = f"{r['eager_us'] / r['graph_us']:.2f}" if r.get("graph_us") else "-"
        graph = f"{r['graph_us']:.1f}" if r.get("graph_us") else r.get("note", "-")
        budget = HOST_TARGET_US.get(r["op"])
        target = "-" if budget is None else f"{budget} ({'met' if r['host_us'] <= budget else '**missed**'})"
        lines.append(f"| {op_label(r)} | {r['preset']} | {r['T']} | {r['eager_us']:.1f} | {r['host_us']:.1f} | "
                     f"{target} | {graph} | {ratio} | {r['kernels']} |")
    if generation:
        experts = generation_experts or {}
        lines += ["", "Greedy generation, eager, Qwen3-MoE at qwen3-30b-a3b's sizes, 2 layers, 64 tokens:", "",
                  "| model | tokens/s | experts implementation |", "|---|---|---|"]
        lines += [f"| {k} | {v:.1f} | {experts.get(k, 'not recorded')} |" for k, v in generation.items()]
    if replay:
        lines += ["", "Graph safety, qwen3-30b-a3b experts at T=16: captured on one routing, replayed on new inputs "
                  "and routes, against the eager call on them (max relative error; 0 = the same bits):", "",
                  "| experts | replay vs eager |", "|---|---|"]
        lines += [f"| {k} | {v if isinstance(v, str) else f'{v:.3g}'} |" for k, v in replay.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", "--presets", dest="presets", nargs="+", default=PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--no-generate", dest="generate", action="store_false")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--graph-safety", action="store_true", help="only the graph-replay check of the experts")
    p.add_argument("--profile", nargs="+", default=None, metavar="OP:PRESET:T",
                   help="print a cProfile of these calls (e.g. fused_experts:qwen3-30b-a3b:16) and stop")
    args = p.parse_args(argv)
    if args.profile:
        print(profile(args))
        return
    if args.graph_safety:
        print(graph_replay_errors())
        return
    records = run(args)
    generation, generation_experts = {}, {}
    if args.generate:
        for label, patched in (("transformers", False), ("moekit patch()", True)):
            generation[label], generation_experts[label] = generate_tokens_per_s(patched)
    replay = graph_replay_errors()
    env = environment() | {"transformers": transformers_version()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eager.json").write_text(json.dumps(
        {"env": env, "records": records, "generate_tokens_per_s": generation, "generate_experts": generation_experts,
         "graph_replay_max_rel_err": replay}, indent=1))
    md = markdown(records, env, generation, replay, generation_experts)
    (args.out / "eager.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
