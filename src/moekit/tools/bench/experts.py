"""Experts benchmark (GPU): moekit.fused_experts against the peers, in the same run
(`moekit bench`, `python benchmarks/bench_experts.py`).

Peers: Hugging Face transformers' experts modules with each ``_experts_implementation``
("eager", "grouped_mm", "batched_mm"), Liger-Kernel's fused MoE (SiLU presets), SGLang's Triton
``fused_moe_kernel`` with its tuned configs (the kernel vLLM and SGLang serve with; sglang_peer.py), and a
plain torch grouped_mm pipeline. Uniform random routing (k distinct experts per token), bf16. A peer whose
package is not installed is skipped with one line saying how to install it; the results name it.

Timing: CUDA-graph replay (eager where an implementation cannot be captured; marked). For
T <= 64 a graph of 8 consecutive calls, each with its own routing and input, cycling over 4 layers'
weights (as consecutive layers of a model run), us per call = replay / 8; above, a graph of one call.
Floors (floors.py): the bytes the timed calls read and write at the copy rate (the distinct experts
each call hits, mean over the calls, as stored, plus x and out), and 2*T*k*3*H*I FLOPs at the bf16
matmul rate measured in this run. Outputs (checks.py): every implementation's, at every T, against
float64 (every row up to T = 1024, 256 random rows above), against the bf16 budget of moekit.metrics.

  moekit bench --preset qwen3-30b-a3b --tokens 1 16 256 --plot experts.png
  python benchmarks/bench_experts.py --out benchmarks/results
  python benchmarks/bench_experts.py --merge run_a.json run_b.json --name experts   (one table, no GPU)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import layouts, presets, reference
from ...experts import fused_experts
from ...metrics import experts_tolerance, within
from .. import _argtypes
from . import checks, floors, sglang_peer
from .timing import copy_rate_words, eager_time_us, environment, graph_time_us

PRESETS = ["gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"]
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
PEERS = ["hf_eager", "hf_grouped_mm", "hf_batched_mm", "liger", "sglang", "torch_grouped_mm"]
BENCH_EXTRA = 'pip install "moekit[bench]"'
PEER_PACKAGES = {  # peer: (module it imports, distribution, how to install it)
    "hf_eager": ("transformers", "transformers", BENCH_EXTRA),
    "hf_grouped_mm": ("transformers", "transformers", BENCH_EXTRA),
    "hf_batched_mm": ("transformers", "transformers", BENCH_EXTRA),
    "liger": ("liger_kernel", "liger-kernel", BENCH_EXTRA),
    "sglang": ("sglang", "sglang", sglang_peer.INSTALL),
}
# Distributions a peer may run beside its own, recorded where installed: SGLang's CUDA alignment comes from
# sgl_kernel (sglang-kernel) or is built with apache-tvm-ffi (sglang_peer.CudaAlign)
PEER_EXTRA_DISTS = {"sglang": ("sglang-kernel", "apache-tvm-ffi")}
DECODE_MAX_T, DECODE_CALLS = 64, 8  # up to this T a graph times this many calls (each its own routing)
MAX_PEER_BYTES = 40e9  # a peer whose working set exceeds this is reported as out of memory, not run


def peer_name(value: str) -> str:
    """A --peers entry: one of PEERS (a typo is one line and exit 2, before any work)."""
    if value not in PEERS:
        raise argparse.ArgumentTypeError(f"unknown peer {value!r}; known peers: {', '.join(PEERS)}")
    return value


def module_available(name: str) -> bool:
    """The module is installed here: found on the path without importing it (an import is the peer's own
    start-up, which may fail or take seconds; the run reports that per case)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def unavailable_peers(names) -> dict[str, str]:
    """{peer: why it cannot run here, and how to install it} for the peers of ``names`` that cannot."""
    why = {}
    for name in names:
        if name not in PEER_PACKAGES:
            continue
        module, _, install = PEER_PACKAGES[name]
        if not module_available(module):
            why[name] = f"{module} is not installed ({install})"
        elif name == "sglang":
            reason = sglang_peer.missing()
            if reason is None:
                try:  # reads sglang's files and defines its kernels: host work, before any GPU work
                    sglang_peer.load()
                except sglang_peer.LoadError as exc:
                    reason = str(exc)
                except Exception as exc:  # noqa: BLE001 - a release whose definitions no longer run here
                    reason = f"loading sglang's kernels failed: {_one_line(exc)} ({sglang_peer.INSTALL})"
            if reason:
                why[name] = reason
    return why


def peer_versions(names) -> dict[str, str]:
    """{distribution: installed version} of the packages the peers ``names`` run (for the results); torch and
    triton are the environment's (timing.environment)."""
    out = {}
    dists = [d for n in names if n in PEER_PACKAGES for d in (PEER_PACKAGES[n][1], *PEER_EXTRA_DISTS.get(n, ()))]
    for dist in dict.fromkeys(dists):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 torch.mm here (the compute floor's rate)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = eager_time_us([lambda: torch.mm(a, b)], reps=20)
    return 2 * 8192 ** 3 / (us * 1e-6)


class Layer:
    """One layer's expert weights in moekit's layout, plus the Hugging Face module over them."""

    def __init__(self, spec, impl_names, device="cuda"):
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        dev, dt = device, torch.bfloat16
        self.spec = spec
        g = _gen(dev)
        self.w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g).mul_(H ** -0.5)
        self.w2 = torch.randn(E, H, I, device=dev, dtype=dt, generator=g).mul_(I ** -0.5)
        self.b13 = self.b2 = None
        if spec.expert_bias:
            self.b13 = torch.randn(E, 2 * I, device=dev, dtype=dt, generator=g).mul_(0.02)
            self.b2 = torch.randn(E, H, device=dev, dtype=dt, generator=g).mul_(0.02)
        self.hf = _hf_experts(spec, self) if any(n.startswith("hf_") for n in impl_names) else None


def _hf_experts(spec, layer):
    """transformers' experts module of this model family, sharing (or converting) the weights."""
    from torch import nn

    if spec.activation == "swiglu_oai":
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                           num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k)
        with torch.device("meta"):
            mod = GptOssExperts(cfg)
        gate_up, down = layouts.to_hf(layer.w13, layer.w2)   # [E, H, 2I] interleaved, [E, I, H]
        mod.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        mod.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
        mod.gate_up_proj_bias = nn.Parameter(layer.b13, requires_grad=False)
        mod.down_proj_bias = nn.Parameter(layer.b2, requires_grad=False)
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        # Mixtral, Qwen3-MoE and DeepSeek-V3 share this experts class body in transformers 5.
        cfg = Qwen3MoeConfig(hidden_size=spec.hidden_size, moe_intermediate_size=spec.intermediate_size,
                             num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, hidden_act="silu")
        with torch.device("meta"):
            mod = Qwen3MoeExperts(cfg)
        mod.gate_up_proj = nn.Parameter(layer.w13, requires_grad=False)   # same [E, 2I, H] layout
        mod.down_proj = nn.Parameter(layer.w2, requires_grad=False)
    return mod


def _torch_grouped_mm(x, layer, tw, tid):
    """The pipeline a torch user writes: sort pairs by expert, two grouped_mm, weight, unsort, sum."""
    spec = layer.spec
    T, k = tid.shape
    flat = tid.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.int() if flat.is_cuda else flat.float(), bins=spec.num_experts, min=0,
                         max=spec.num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, layer.w13.transpose(1, 2), offs=offs)
    if layer.b13 is not None:
        h = h + layer.b13[flat[order]]
    if spec.activation == "silu_and_mul":
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
    else:
        g, u = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
        a = (u + 1) * g * torch.sigmoid(1.702 * g)
    y = torch._grouped_mm(a, layer.w2.transpose(1, 2), offs=offs)
    if layer.b2 is not None:
        y = y + layer.b2[flat[order]]
    y = y * tw.reshape(-1)[order, None]
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, k, -1).sum(1)


def implementations(spec, names):
    def moekit(x, layer, tw, tid):
        return fused_experts(x, layer.w13, layer.w2, tw, tid, activation=spec.activation,
                             w13_bias=layer.b13, w2_bias=layer.b2)

    def hf(kind):
        def run(x, layer, tw, tid):
            layer.hf.config._experts_implementation = kind
            return layer.hf(x, tid.long(), tw.to(x.dtype))
        return run

    def liger(x, layer, tw, tid):
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        return LigerFusedMoEFunction.apply(x, layer.w13, layer.w2, tid, tw.to(x.dtype))

    def sglang(x, layer, tw, tid):
        return sglang_peer.load().fused_experts(x, layer.w13, layer.w2, tw, tid, activation=spec.activation,
                                                w13_bias=layer.b13, w2_bias=layer.b2)

    table = {"moekit": moekit, "hf_eager": hf("eager"), "hf_grouped_mm": hf("grouped_mm"),
             "hf_batched_mm": hf("batched_mm"), "liger": liger, "sglang": sglang, "torch_grouped_mm": _torch_grouped_mm}
    return {n: table[n] for n in ["moekit"] + names if n in table}


def supported(name, spec, T) -> str | None:
    """None if the peer can run this case, else why not."""
    if name == "liger" and spec.activation != "silu_and_mul":
        return "SiLU only"
    if name == "hf_batched_mm":
        need = T * spec.top_k * 3 * spec.hidden_size * spec.intermediate_size * 2
        if need > MAX_PEER_BYTES:
            return f"gathers {need / 1e9:.0f} GB of weights"
    if name == "sglang":
        return sglang_peer.load().why_not(spec, T)
    return None


_GEN: dict = {}


def _gen(device):
    """Inputs come from a generator of their own: a failed capture of a peer leaves the default
    CUDA generator unusable ('offset increment outside graph capture')."""
    if device not in _GEN:
        _GEN[device] = torch.Generator(device=device)
        _GEN[device].manual_seed(0)
    return _GEN[device]


def reseed(what: str, device="cuda") -> None:
    """Draw what follows from a seed of its own (``what``: a preset's weights, a (preset, T) case), so that a
    case's routes and inputs do not depend on which presets and token counts ran before it in the process: the
    same row of two runs with other --tokens lists sees the same experts hit."""
    _gen(device).manual_seed(zlib.crc32(what.encode()))


def routes(spec, T, device="cuda"):
    g = _gen(device)
    tid = torch.rand(T, spec.num_experts, device=device, generator=g).argsort(dim=1)[:, :spec.top_k].int().contiguous()
    return torch.softmax(torch.randn(T, spec.top_k, device=device, generator=g), -1), tid


EAGER_ONLY = {"hf_eager", "liger"}  # host syncs (nonzero, .item()): a capture attempt only leaks its memory pool


def make_cases(spec, T, layers) -> list[tuple]:
    """(x [T, H], layer, topk_weights [T, k], topk_ids [T, k]) per call, each with its own routing and input, on
    the layers' device: DECODE_CALLS calls cycling over the layers for T <= DECODE_MAX_T (decode: a graph of
    consecutive layers), one call above."""
    calls, used = (DECODE_CALLS, len(layers)) if T <= DECODE_MAX_T else (1, 1)
    device = layers[0].w13.device.type
    reseed(f"{spec.name} T={T}", device)
    cases = []
    for i in range(calls):
        tw, tid = routes(spec, T, device)
        x = torch.randn(T, spec.hidden_size, device=device, generator=_gen(device)).bfloat16()
        cases.append((x, layers[i % used], tw, tid))
    return cases


def time_impl(name, fn, cases):
    """(us per call, mode): a CUDA graph when the implementation can be captured, else eager."""
    calls = [lambda c=c: fn(*c) for c in cases]
    if name in EAGER_ONLY:
        return eager_time_us(calls, reps=10), "eager"
    try:
        return graph_time_us(calls, replays=20), "graph"
    except Exception:  # noqa: BLE001 - a host sync or data-dependent shape: time it eagerly
        torch.cuda.synchronize()
        return eager_time_us(calls, reps=10), "eager"


class Progress:
    """What a run reports as it goes: ``case`` before a (preset, T) case is measured, ``row`` after.
    This default prints each row's fields on one line (the script's log); `moekit bench` shows rich's
    progress instead."""

    def case(self, preset: str, T: int) -> None:
        pass

    def row(self, row: dict) -> None:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def drop_unavailable(args, announce=print) -> dict[str, str]:
    """Take the peers that cannot run here out of ``args.peers``, one line each, before any GPU work; the
    reasons go to ``args.skipped_peers`` (and from there into the results)."""
    skipped = unavailable_peers(args.peers)
    for name, why in skipped.items():
        announce(f"skipping peer {name}: {why}")
    args.peers = [p for p in args.peers if p not in skipped]
    args.skipped_peers = {**getattr(args, "skipped_peers", {}), **skipped}
    return skipped


def run(args, progress: Progress | None = None):
    progress = progress or Progress()
    drop_unavailable(args)
    rate = matmul_rate()
    print(f"bf16 matmul rate here: {rate / 1e12:.0f} TFLOP/s", flush=True)
    records = []

    def on_row(row):
        records.append(row)
        save(args, records, rate)  # after every row: a call cut by a time limit keeps what it measured
        progress.row(row)

    for name in args.presets:
        run_preset(args, presets.get(name), rate, on_row, progress)
        torch.cuda.empty_cache()
    return records, rate


def save(args, records, rate, render=None):
    """Write {name}.json and {name}.md (``render(records, env, rate)``; default this script's table)."""
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    result = {"env": env, "matmul_rate": rate}
    if render is None:  # this benchmark's peers: which ran (and their versions, in env too), which were skipped and why
        env["peer_versions"] = peer_versions(args.peers)
        result |= {"peers": args.peers, "peer_versions": env["peer_versions"],
                   "skipped_peers": getattr(args, "skipped_peers", {})}
    result["records"] = records
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    md = (render(records, env, rate) if render
          else markdown(records, env, rate, args.peers, skipped=result["skipped_peers"],
                        versions=result["peer_versions"]))
    (args.out / f"{args.name}.md").write_text(md)
    return md


def make_layers(spec, n: int, impl_names, device="cuda") -> list[Layer]:
    """``n`` layers of the preset's weights, drawn from the preset's own seed."""
    reseed(f"{spec.name} weights", device)
    return [Layer(spec, impl_names, device) for _ in range(n)]


def floor_fields(spec, T, cases, rate) -> dict:
    """The row's floor: the experts the timed calls hit (each call's distinct experts, and their mean), one
    expert's bytes as stored (w13, w2 and any biases) and the floor (floors.py) with the bound that sets it."""
    layer = cases[0][1]
    hit, per_call = floors.experts_hit([tid for _, _, _, tid in cases])
    per_expert = floors.expert_bytes(spec.num_experts, layer.w13, layer.w2, layer.b13, layer.b2)
    floor, kind = floors.floor_us(spec, T, hit, per_expert, rate)
    return {"experts_hit": hit, "experts_hit_per_call": per_call, "expert_bytes": per_expert, "floor_us": floor,
            "floor_kind": kind}


def _reference_fn(spec):
    def ref(x, layer, tw, tid):
        return reference.fused_experts(x, layer.w13, layer.w2, tw, tid, activation=spec.activation,
                                       w13_bias=layer.b13, w2_bias=layer.b2)
    return ref


def checked(args, T) -> bool:
    """Whether this T's outputs are checked: every T unless --accuracy-tokens names some."""
    tokens = getattr(args, "accuracy_tokens", None)
    return tokens is None or T in tokens


def run_preset(args, spec, rate, on_row, progress: Progress | None = None):
    """Every T of one preset, each row handed to ``on_row`` as it is measured; the weights are freed on return.
    A peer that fails on a case is recorded as failed (with its error) and the run goes on. Every timed
    implementation's output is checked against float64 on the timed calls (checks.py): ``{impl}_err`` (RMS) and
    ``{impl}_max_err``, the worst over the calls."""
    progress = progress or Progress()
    name = spec.name
    n_layers = min(args.layers, 4)
    layers = make_layers(spec, n_layers, args.peers)
    impls = implementations(spec, args.peers)
    for T in args.tokens:
        progress.case(name, T)
        cases = make_cases(spec, T, layers)
        row = {"preset": name, "T": T, "layers": n_layers, **floor_fields(spec, T, cases, rate)}
        rows, refs = None, None
        if checked(args, T):
            rows = checks.checked_rows(T, f"{name} T={T}")
            refs = checks.references(_reference_fn(spec), cases, rows)
            row["checked_rows"], row["checked_calls"] = checks.rows_words(T, rows), len(cases)
        for impl, fn in impls.items():
            why = supported(impl, spec, T)
            if why:
                row[impl] = None
                row[f"{impl}_note"] = why
                continue
            if impl == "sglang":
                row |= {f"sglang_{k}": v for k, v in sglang_peer.load().describe(spec, T).items()}
            try:
                us, mode = time_impl(impl, fn, cases)
            except torch.OutOfMemoryError:
                us, mode = None, "out of memory"
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - one implementation's failure must not end the run
                us, mode = None, "failed"
                row[f"{impl}_note"] = f"failed: {_one_line(exc)}"
                print(f"{name} T={T}: {impl} {row[f'{impl}_note']}", flush=True)
                _settle()
            row[impl], row[f"{impl}_mode"] = us, mode
            if us is not None and refs is not None:
                check_impl(row, impl, fn, cases, refs, rows)
        timed = {p: row[p] for p in impls if p != "moekit" and row.get(p) is not None}
        if timed and row.get("moekit"):
            best = min(timed, key=timed.get)
            row["best_peer_us"], row["best_peer"] = timed[best], best
            row["speedup_vs_best_peer"] = timed[best] / row["moekit"]
            row["floor_ratio"] = row["moekit"] / row["floor_us"]
        on_row(row)
        del cases, refs
        torch.cuda.empty_cache()


def check_impl(row, impl, fn, cases, refs, rows) -> None:
    """``row[f"{impl}_max_err"]``, ``row[f"{impl}_err"]`` (RMS) of ``fn`` on the timed calls; a check that fails
    to run is a note, the time stays."""
    try:
        row[f"{impl}_max_err"], row[f"{impl}_err"] = checks.worst_errors(fn, cases, refs, rows)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory beside the references
        row[f"{impl}_err_note"] = f"check failed: {_one_line(exc)}"
        print(f"{row['preset']} T={row['T']}: {impl} {row[f'{impl}_err_note']}", flush=True)
        _settle()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _settle() -> None:
    """Let the device finish after a failed call; a fault that poisoned the context fails every later call
    too, and each is then recorded the same way."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001, S110 - the next call reports the device's state
        pass


def _rates(r) -> tuple[float | None, float | None]:
    """moekit's (TFLOP/s, GB/s of expert weights hit) for a record (records before ``expert_bytes``: bf16 w13 + w2)."""
    us = r.get("moekit")
    if not us:
        return None, None
    spec = presets.get(r["preset"])
    params = 3 * spec.hidden_size * spec.intermediate_size
    weight_bytes = r["experts_hit"] * r.get("expert_bytes", params * 2)
    return 2 * r["T"] * spec.top_k * params / us * 1e-6, weight_bytes / us * 1e-3


def _fmt(v, digits=1):
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def _rate_words(rate) -> str:
    """The header's words for one run's rate, or a merged file's rate per run."""
    if isinstance(rate, (int, float)):
        return f"this run: {rate / 1e12:.0f} TFLOP/s"
    return "each run (in order): " + " / ".join(f"{r / 1e12:.0f}" for r in rate) + " TFLOP/s"


def merge(paths, args):
    """One table from several runs' JSON files (a full sweep split over time-limited device calls):
    records in the order given, a later file's (preset, T) replacing an earlier one's."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    by_case = {}
    for run_ in runs:
        for r in run_["records"]:
            by_case[(r["preset"], r["T"])] = r
    order = {name: i for i, name in enumerate(PRESETS)}
    records = sorted(by_case.values(), key=lambda r: (order.get(r["preset"], len(order)), r["T"]))
    env = dict(runs[-1]["env"], date=" and ".join(sorted({r["env"]["date"] for r in runs})))
    rates = [r["matmul_rate"] for r in runs]
    versions = {k: v for run_ in runs for k, v in run_.get("peer_versions", {}).items()}
    if versions:
        env["peer_versions"] = versions
    # a peer skipped by one run but measured by another is not skipped in the merged table
    skipped = {k: v for run_ in runs for k, v in run_.get("skipped_peers", {}).items()
               if not any(r.get(k) is not None for r in records)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"env": env, "matmul_rate": rates, "merged_from": [Path(p).name for p in paths], "peer_versions": versions,
         "skipped_peers": skipped, "records": records}, indent=1))
    md = markdown(records, env, rates, args.peers, skipped=skipped, versions=versions)
    (args.out / f"{args.name}.md").write_text(md)
    return md


NOTE_CELL = 28  # longer notes go below the table, numbered, so the table stays readable


def markdown(records, env, rate, impl_names, skipped=None, versions=None):
    """The table of one run (or a merge); ``skipped``: {peer: why it did not run}; ``versions``: {package: version}
    (default: the env block's peer_versions)."""
    cols = ["moekit"] + [p for p in impl_names if any(r.get(p) is not None or f"{p}_note" in r for r in records)]
    versions = versions or env.get("peer_versions")
    tol = experts_tolerance(torch.bfloat16)
    lines = [f"# Experts benchmark ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. bf16, uniform random routing.",
             "us per fused_experts call (alignment and combine included). CUDA-graph replay: T <= "
             f"{DECODE_MAX_T} a graph of {DECODE_CALLS}",
             f"calls, each with its own routing, over {_layers_words(records)}: us = replay / {DECODE_CALLS}; above, "
             "one call per graph; `(e)` = eager (cannot be captured).",
             "floor = max(bytes of the distinct experts each timed call hits (mean over the calls; w13, w2 and biases",
             f"as stored) + x + out at {copy_rate_words(env)}, FLOPs at the bf16 matmul rate measured in",
             f"{_rate_words(rate)}). x floor = moekit / floor."]
    if any("experts_hit_per_call" not in r for r in records):
        lines.append("Rows without experts_hit_per_call in the JSON (earlier runs): their floor counts the first "
                     "timed call's experts only.")
    if versions:
        lines.append("Peer versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")
    if skipped:
        lines.append("Peers skipped (not run): " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ".")
    lines += ["", "| preset | T | " + " | ".join(cols) + " | best peer / moekit | floor us | x floor | "
              "moekit TFLOP/s | moekit GB/s | moekit RMS err |",
              "|---|---|" + "---|" * (len(cols) + 6)]
    notes: list[str] = []
    for r in records:
        cells = []
        for c in cols:
            if r.get(c) is None:
                note = r.get(f"{c}_note", r.get(f"{c}_mode", "-"))
                if len(note) > NOTE_CELL:
                    text = f"{c}: {note}"
                    if text not in notes:
                        notes.append(text)
                    note = f"n/a [{notes.index(text) + 1}]"
                cells.append(note)
            else:
                cells.append(_fmt(r[c]) + (" (e)" if r.get(f"{c}_mode") == "eager" else ""))
        tflops, gbps = _rates(r)
        lines.append(f"| {r['preset']} | {r['T']} | " + " | ".join(cells) +
                     f" | {_fmt(r.get('speedup_vs_best_peer'), 2)} | {_fmt(r['floor_us'])} ({r['floor_kind']}) | "
                     f"{_fmt(r.get('floor_ratio'), 2)} | {_fmt(tflops)} | {_fmt(gbps, 0)} | "
                     f"{checks.error_cell(r.get('moekit_err'), r.get('moekit_max_err'), tol)} |")
    if notes:
        lines += [""] + [f"[{i}] {text}" for i, text in enumerate(notes, 1)]
    lines += _error_table(records, cols, tol)
    lines += _sglang_notes(records)
    return "\n".join(lines) + "\n"


def _layers_words(records) -> str:
    """What the decode graphs cycled over, as the rows ran (records before the ``layers`` field used 4): one
    count, or the most common one and each other with its presets (and token counts where a preset has both)."""
    decode = [r for r in records if r["T"] <= DECODE_MAX_T] or records
    by_count: dict[int, list[dict]] = {}
    for r in decode:
        by_count.setdefault(r.get("layers", 4), []).append(r)
    if len(by_count) <= 1:
        return f"{next(iter(by_count), 4)} layers' weights"
    main = max(by_count, key=lambda n: len(by_count[n]))
    others = []
    for n, rows in by_count.items():
        if n == main:
            continue
        parts = []
        for preset in dict.fromkeys(r["preset"] for r in rows):
            ts = [r["T"] for r in rows if r["preset"] == preset]
            whole = len(ts) == sum(r["preset"] == preset for r in decode)
            parts.append(preset if whole else f"{preset} T = {', '.join(map(str, ts))}")
        others.append(f"{n} for {'; '.join(parts)}")
    return f"{main} layers' weights ({'; '.join(others)})"


def _error_table(records, cols, tol) -> list[str]:
    """Every implementation's RMS error against float64 per row that was checked, over budget in bold."""
    checked_cols = [c for c in cols if any(r.get(f"{c}_err") is not None for r in records)]
    rows = [r for r in records if any(r.get(f"{c}_err") is not None for c in checked_cols)]
    if not rows:
        return []
    lines = ["", "Outputs against float64 (relative RMS error, the worst of the timed calls; every row up to "
             f"T = {checks.FULL_CHECK_MAX_T}, {checks.SAMPLE_ROWS} rows drawn at random above). **Bold**: over the "
             f"bf16 budget of moekit.metrics ({checks.budget_words(tol)}).", "",
             "| preset | T | rows checked | " + " | ".join(checked_cols) + " |",
             "|---|---|---|" + "---|" * len(checked_cols)]
    for r in rows:
        cells = [checks.error_cell(r.get(f"{c}_err"), r.get(f"{c}_max_err"), tol) if r.get(f"{c}_err") is not None
                 else r.get(f"{c}_err_note", "-") for c in checked_cols]
        what = r.get("checked_rows", "all, first call only")  # (earlier runs checked the first call)
        lines.append(f"| {r['preset']} | {r['T']} | {what} | " + " | ".join(cells) + " |")
    over = [(c, r["preset"], r["T"]) for c in checked_cols for r in rows
            if r.get(f"{c}_err") is not None and not within(tol, r.get(f"{c}_max_err"), r[f"{c}_err"])]
    if over:
        lines += ["", checks.over_budget_words(over)]
    return lines


def _sglang_notes(records) -> list[str]:
    """Per preset, the config the SGLang peer ran with and the kernels that aligned and summed."""
    rows = [r for r in records if "sglang_config" in r]
    if not rows:
        return []
    lines = ["", "SGLang fused_moe_kernel: the engine's config lookup for the shape on this GPU, its alignment and sum "
             "over k (per row in the JSON):"]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        parts = []
        for key in ("config", "align", "combine"):
            by_value: dict[str, list[int]] = {}
            for r in mine:
                by_value.setdefault(r[f"sglang_{key}"], []).append(r["T"])
            parts.append(f"{key} " + "; ".join(v if len(by_value) == 1 else f"{v} (T = {', '.join(map(str, ts))})"
                                                for v, ts in by_value.items()))
        lines.append(f"- {preset}: " + ". ".join(parts) + ".")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", "--presets", dest="presets", nargs="+", type=_argtypes.preset_name, default=PRESETS,
                   help=f"presets to time (default: {' '.join(PRESETS)})")
    p.add_argument("--tokens", nargs="+", type=_argtypes.positive_token_count, default=TOKENS,
                   help=f"token counts (default: {' '.join(map(str, TOKENS))})")
    p.add_argument("--peers", nargs="*", type=peer_name, default=PEERS,
                   help=f"peers to time against (default: all; those not installed are skipped): {', '.join(PEERS)}")
    p.add_argument("--layers", type=_argtypes.positive_int, default=4,
                   help="layers of weights a graph cycles through, so that no call finds its weights in L2 "
                        "(default: 4)")
    p.add_argument("--accuracy-tokens", nargs="*", type=_argtypes.positive_token_count, default=None,
                   help="token counts whose outputs are also checked against float64 (default: every --tokens "
                        "value; none given: no check)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")),
                   help="folder for NAME.json and NAME.md (default: $OUT, else benchmarks/results)")
    p.add_argument("--name", default="experts", help="the result files' name (default: experts)")


def script_main(doc: str, add_args, run_fn, render=None, argv=None) -> None:
    """A benchmark module as a script: its arguments, a run, the saved table printed."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    records, rate = run_fn(args)
    print(save(args, records, rate, render))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="no run: write {name}.json/.md merged from these runs' results (no GPU needed)")
    args = p.parse_args(argv)
    if args.merge:
        print(merge(args.merge, args))
        return
    records, rate = run(args)
    print(save(args, records, rate))
