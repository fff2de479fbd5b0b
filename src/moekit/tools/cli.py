"""The `moekit` command: verify (the accuracy gate), bench, explain, presets."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import _invariant, _triton, gate, presets
from ..experts import backends, configs as expert_configs
from ..formats import FOUR_BIT_FORMATS, recipe_format
from ..routing import tiers as router_tiers
from . import _argtypes, _interpreter, tune
from .bench import experts, lowbit
from .verify import runner
from .verify.router_checks import implementations


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_presets(args) -> int:
    table = Table(title="moekit presets")
    for col in ("preset", "H", "I", "E", "k", "routing", "activation", "router bias", "groups"):
        table.add_column(col, no_wrap=True)  # names are looked up by users: never cut
    for name in presets.names():
        s = presets.get(name)
        groups = f"{s.num_groups} keep {s.topk_groups}, x{s.routed_scaling_factor}" if s.routing == "sigmoid_grouped" else ""
        table.add_row(name, str(s.hidden_size), str(s.intermediate_size), str(s.num_experts), str(s.top_k),
                      s.routing + (" (renorm)" if s.renormalize and s.routing == "softmax_topk" else ""),
                      s.activation, "yes" if s.router_bias else "", groups)
    _console().print(table)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _console():
    """rich's console; piped output is not cut at 80 columns (it keeps the table's own width)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _json_report(results) -> str:
    """Standard JSON (no Infinity or NaN: a crashed check's errors are null)."""
    def finite(value):
        return None if isinstance(value, float) and not math.isfinite(value) else value

    return json.dumps([{k: finite(v) for k, v in r.as_dict().items()} for r in results], indent=1, allow_nan=False)


def cmd_explain(args) -> int:
    device = _device()
    names = args.preset or (list(lowbit.NATIVE) if args.weights == "native" else presets.names())
    try:  # every preset's format first: a mistake prints nothing else
        recipes = {name: "dense" if args.weights == "bf16" else lowbit.preset_recipe(name, args.weights)
                   for name in names}
    except ValueError as exc:
        return _argtypes.fail("moekit explain", f"--weights: {exc}")
    if not args.batch_invariant:
        return _explain(args, device, recipes)
    with _invariant.batch_invariant():  # for this command only: main() may run in a process that goes on
        return _explain(args, device, recipes)


def _explain(args, device, recipes) -> int:
    print(f"batch-invariant mode: {'on' if _invariant.enabled() else 'off'}" + (
        " (each token's bits independent of its batch: the kernels below fix one reduction order per shape)"
        if _invariant.enabled() else f" ({_invariant.ENV}=1 or --batch-invariant turns it on)"))
    for name, recipe in recipes.items():
        spec = presets.get(name)
        for T in args.tokens:
            print(f"[{name}] " + router_tiers.explain(T, spec.hidden_size, spec.num_experts, device).replace("\n", f"\n[{name}] "))
            print(f"[{name}] " + explain_experts(spec, T, device, getattr(torch, args.dtype), recipe=recipe))
    return 0


def explain_experts(spec, num_tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    recipe: str = "dense") -> str:
    """Which experts backend and block configuration serve ``num_tokens`` tokens of ``spec`` with weights
    quantized as ``recipe`` ("dense", or a :data:`moekit.formats.RECIPES` name), and why: the oracle's and the
    config table's own answers, asked as fused_experts asks them."""
    fmt = "dense" if recipe == "dense" else recipe_format(recipe)
    act_quant = "fp8_group" if fmt == "fp8" else None  # FP8 checkpoints run W8A8
    # 4-bit codes as FusedMoE keeps them on a GPU (formats.prepare): the gate's class of the call it serves
    layout = "pairs" if fmt in FOUR_BIT_FORMATS and torch.device(device).type == "cuda" else "packed"
    call = backends.ExpertsCall(fmt, dtype, device, num_tokens, act_quant, activation=spec.activation, layout=layout)
    if backends.select_backend(call).name != "triton":
        return "fused_experts " + backends.explain(call).replace("\n", "\n  ")
    cfg, source = expert_configs.choose(num_tokens, spec.num_experts, spec.top_k, 2 * spec.intermediate_size,
                                        spec.hidden_size, device, dtype, expert_configs.config_family(fmt, act_quant))
    mode = f"mode {cfg.mode}" + (f", BLOCK_M={cfg.block_m}" if cfg.mode == "aligned" else "") + (
        ", GEMM2 per pair then the combine" if cfg.split_slots else "")
    codes = "" if layout == "packed" else f", {layout} codes"
    from ..experts import triton_backend  # as backends imports it: kernels built on first use

    gemm1, gemm2 = triton_backend.launched_configs(cfg, fmt)  # the tiles launched, after the format's K steps
    return (f"fused_experts T={num_tokens} ({fmt} weights{codes}): triton, {mode}, gemm1 {gemm1}, gemm2 {gemm2}"
            f" -- {source}")


def cmd_verify(args) -> int:
    if not args.batch_invariant:
        return _verify(args)
    # The mode for this process and, through the environment, for its isolated children; both restored after, as
    # main() may be called in a process that goes on (tests, notebooks).
    saved = os.environ.get(_invariant.ENV)
    os.environ[_invariant.ENV] = "1"
    try:
        with _invariant.batch_invariant():
            return _verify(args)
    finally:
        if saved is None:
            os.environ.pop(_invariant.ENV, None)
        else:
            os.environ[_invariant.ENV] = saved


def _verify(args) -> int:
    try:
        runner.load_plugins()
    except ValueError as exc:
        return _argtypes.fail("moekit verify", str(exc))
    device = _device()
    console = _console()
    on_gpu = device.type == "cuda"
    names = args.preset or presets.names()
    tokens = args.tokens or ([0, 1, 8, 64, 129, 1000] if on_gpu else [0, 1, 7, 33])  # (0: no token, no launch)
    # The interpreter computes bf16 dots wrongly: CPU runs check the kernels in fp16.
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_gpu else torch.float16)
    impls = implementations(device)
    if _invariant.enabled():  # cuBLAS is refused in the mode: the router runs the Triton kernel or torch
        impls = {op: [i for i in v if i != "cublas"] for op, v in impls.items()}
    if not on_gpu and dtype == torch.bfloat16:
        impls = {op: [i for i in v if i not in ("triton", "fused")] for op, v in impls.items()}
        if not args.backend:
            console.print("note: Triton's interpreter computes bf16 dots wrongly; kernels are checked in fp16 "
                          "on the CPU (run without --dtype) and in bf16 on a GPU")
    groups = runner.groups(device, dtype, impls)
    if args.backend:
        if args.backend not in groups:
            bf16_off = not on_gpu and dtype == torch.bfloat16 and args.backend in runner.groups(
                device, dtype, implementations(device))
            why = (": Triton's interpreter computes bf16 dots wrongly, so its kernels are checked in fp16 on the CPU "
                   "(run without --dtype) and in bf16 on a GPU" if bf16_off else "")
            return _argtypes.fail("moekit verify", f"--backend must be one of {groups} here, got {args.backend!r}{why}")
        groups = [args.backend]
    if args.backend and not args.isolate and args.progress_lines:  # a child: its parent prints the table
        report = runner.report_case
        results = runner.run_group(args.backend, names, tokens, dtype, device, impls, on_gpu, report)
        if args.json:
            args.json.write_text(_json_report(results))
        return 1 if any(not r.ok for r in results) else 0
    console.print(f"moekit verify on {torch.cuda.get_device_name() if on_gpu else 'CPU'}: backends "
                  f"{', '.join(groups)} ({'each in its own process' if args.isolate else 'in this process'}), "
                  f"router and experts on {'real' if on_gpu else 'scaled-down'} presets, "
                  f"dtype {str(dtype).replace('torch.', '')}"
                  + (", batch-invariant mode with bitwise invariance checks" if _invariant.enabled() else ""))
    start = time.time()
    passthrough = ["--preset", *names, "--tokens", *map(str, tokens)] + (["--dtype", args.dtype] if args.dtype else [])
    results = _run_groups(groups, names, tokens, console, lambda group, on_case: (
        runner.run_isolated(group, passthrough, on_case)[0] if args.isolate
        else runner.run_group(group, names, tokens, dtype, device, impls, on_gpu, on_case)))
    elapsed = time.time() - start
    console.print(_summary_table(results, f"accuracy against float64 ({elapsed:.0f} s)"))
    console.print(_ERROR_NOTE, markup=False, highlight=False)
    failed = [r for r in results if not r.ok]
    if args.full or failed:
        console.print(_case_table(results if args.full else failed, "every check" if args.full else "failed checks"))
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        try:
            args.json.write_text(_json_report(results))
        except OSError as exc:
            return _argtypes.fail("moekit verify", f"could not write --json {args.json}: {exc}")
    return 1 if failed else 0


_ERROR_NOTE = ("max err: max |got - ref| / max |ref| (routes: the routing weights' absolute error; [invariant] rows: "
               "bits, budget 0); rms rel: ||got - ref|| / ||ref||; each against the budget it was held to")


def _is_route(op: str) -> bool:
    """A routing row: top-k agreement and the weights' error, no RMS."""
    return op.split("[")[0] in ("route", "fused_router")


def _against(value: float, budget: float | None) -> str:
    return f"{value:.1e}" + ("" if budget is None else f" / {budget:.0e}")


def _worst(rows, value, budget):
    """The row whose error is the largest share of its budget (the largest error where none has a budget)."""
    return max(rows, key=lambda r: (getattr(r, value) / b if (b := getattr(r, budget)) else getattr(r, value),
                                    getattr(r, value)))


def _summary_table(results, title: str) -> Table:
    """One row per op and implementation: its checks, its worst errors against their budgets, and how many failed."""
    table = Table(title=title)
    for col in ("op", "impl", "checks", "worst max err / budget", "worst rms rel / budget", "top-k agree", "status"):
        table.add_column(col)
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        groups.setdefault((r.op, r.impl), []).append(r)
    for (op, impl), rows in groups.items():
        routes = _is_route(op)
        worst_max, worst_rms = _worst(rows, "max_rel", "max_budget"), _worst(rows, "rms_rel", "rms_budget")
        failed = sum(not r.ok for r in rows)
        # names such as fused_experts[mxfp4] are text, not rich markup (which would drop the bracket)
        table.add_row(escape(op), escape(impl), str(len(rows)), _against(worst_max.max_rel, worst_max.max_budget),
                      "" if routes else _against(worst_rms.rms_rel, worst_rms.rms_budget),
                      f"{min(r.agree for r in rows):.3f}" if routes else "",
                      "[green]PASS[/]" if not failed else f"[red]{failed} FAILED[/]")
    return table


def _case_table(results, title: str) -> Table:
    """One row per check (preset and token count), with why it failed."""
    table = Table(title=title)
    for col in ("op", "impl", "preset", "T", "max err / budget", "rms rel / budget", "top-k agree", "status"):
        table.add_column(col)
    for r in results:
        status = "[green]PASS[/]" if r.ok else f"[red]FAILED[/] {escape(r.detail)}"
        routes = _is_route(r.op)
        table.add_row(escape(r.op), escape(r.impl), escape(r.preset), str(r.tokens), _against(r.max_rel, r.max_budget),
                      "" if routes else _against(r.rms_rel, r.rms_budget), f"{r.agree:.3f}" if routes else "", status)
    return table


def _run_groups(groups, names, tokens, console, run):
    """Every group's results, with progress per case: a bar on a terminal, a line per group otherwise."""
    per_group = len(names) * len(tokens)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("checking", total=len(groups) * per_group)
        for group in groups:
            started = time.time()
            if not console.is_terminal:
                print(f"checking {group}: {per_group} cases ({_count(len(names), 'preset')} x "
                      f"{_count(len(tokens), 'token count')})", flush=True)
            bar.update(task, description=f"{group}")

            def on_case(name, T, group=group):
                bar.update(task, advance=1, description=f"{group}: {name} T={T}")

            done = run(group, on_case)
            results += done
            failed = sum(not r.ok for r in done)
            if not console.is_terminal:
                print(f"  {group}: {len(done)} checks, {failed} failed, {time.time() - started:.0f} s", flush=True)
    return results


def cmd_bench(args) -> int:
    if args.weights != "bf16":
        args.name = "lowbit" if args.name == "experts" else args.name
        if args.presets is experts.PRESETS:  # no --preset: the low-bit bench's own (presets with a checkpoint format)
            args.presets = list(lowbit.DEFAULT_PRESETS)
        try:  # fail on a preset without a low-bit format before any GPU work
            [lowbit.preset_recipe(name, args.weights) for name in args.presets]
        except ValueError as exc:
            return _argtypes.fail("moekit bench", f"--weights: {exc}")
    if args.plot and not experts.module_available("matplotlib"):  # asked for: say so now, not after the run
        return _argtypes.fail("moekit bench", f"--plot needs matplotlib ({experts.BENCH_EXTRA})")
    if not torch.cuda.is_available():
        return _argtypes.fail("moekit bench", "needs a CUDA GPU (its timings are CUDA-graph replays); `moekit verify` "
                                               "checks accuracy on this machine")
    console = _console()
    if args.weights == "bf16":
        experts.drop_unavailable(args)  # one line per peer not installed, before any GPU work
        with _BenchProgress(console, len(args.presets) * len(args.tokens)) as progress:
            records, rate = experts.run(args, progress)
        print(experts.save(args, records, rate))
        impls = ["moekit"] + args.peers
    else:
        with _BenchProgress(console, len(args.presets) * len(args.tokens)) as progress:
            records, rate = lowbit.run(args, progress)
        print(experts.save(args, records, rate, lowbit.markdown))
        impls = lowbit.IMPLS
    if args.plot:
        from .bench.plot import plot  # matplotlib: the [bench] extra

        gpu = torch.cuda.get_device_name()
        for name in args.presets:
            path = Path(args.plot)
            target = path if len(args.presets) == 1 else path.with_name(f"{path.stem}_{name}{path.suffix}")
            print(f"wrote {plot(records, impls, target, preset=name, gpu=gpu, metric=args.metric)}")
    return 0


class _BenchProgress(experts.Progress):
    """`moekit bench`'s progress per preset and token count: a bar on a terminal, with a line per case above
    it; piped, the line per case alone."""

    def __init__(self, console, total: int):
        self.console = console
        self.total, self.done, self.started = total, 0, time.time()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, disable=not console.is_terminal)
        self.task = self.bar.add_task("bench", total=total)

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def case(self, preset: str, T: int) -> None:
        self.bar.update(self.task, description=f"{preset} T={T}")

    def row(self, row: dict) -> None:
        self.done += 1
        self.bar.update(self.task, advance=1)
        line = f"[{self.done}/{self.total}, {time.time() - self.started:.0f} s] {case_line(row)}"
        if self.console.is_terminal:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)


def case_line(row: dict) -> str:
    """One line for a measured case: each implementation's time, then moekit against the best peer."""
    times = []
    for mode_key in [k for k in row if k.endswith("_mode")]:
        impl = mode_key[: -len("_mode")]
        us = row.get(impl)
        times.append(f"{impl} {us:.1f}" if us is not None else f"{impl} {row[mode_key]}")
    line = f"{row['preset']} T={row['T']}: " + ", ".join(times) + " us"
    if row.get("speedup_vs_best_peer"):
        line += f"; best peer {row.get('best_peer', '')} / moekit = {row['speedup_vs_best_peer']:.2f}"
    elif row.get("speedup_vs_bf16"):
        line += f"; bf16 / low-bit = {row['speedup_vs_bf16']:.2f}"
    return line


def build_parser() -> argparse.ArgumentParser:
    p = _argtypes.Parser(prog="moekit", description="Accurate, fast MoE inference layers.")
    sub = p.add_subparsers(dest="command")
    v = sub.add_parser("verify", help="check every implementation on this machine against float64 references",
                       description="Check every implementation this machine has (router GEMM, routing, experts in "
                       "every weight format, the whole layer) against float64 references and exit non-zero on any "
                       "failure. On a CPU: the torch paths and the Triton kernels through Triton's interpreter, on "
                       "scaled-down presets; on a GPU: every preset at its real sizes. Each backend group runs in its "
                       "own process, so one that crashes is reported and the others go on.")
    v.add_argument("--preset", nargs="+", type=_argtypes.preset_name, help="presets to check (default: all)")
    v.add_argument("--tokens", nargs="+", type=_argtypes.token_count,
                   help="token counts (default: 0 1 7 33 on CPU, 0 1 8 64 129 1000 on GPU)")
    v.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="activation/weight dtype")
    v.add_argument("--json", type=_argtypes.new_file, help="write the full report here (its folder must exist)")
    v.add_argument("--backend", help="check only this backend group (torch, triton, cublas, layer, or a plugin's)")
    v.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every group in this process (default: one child process per backend group)")
    v.add_argument("--batch-invariant", action="store_true",
                   help=f"run in batch-invariant mode ({_invariant.ENV}=1) and add its bitwise invariance checks: a "
                        "token alone against the same token in batches of other tokens, at several positions")
    v.add_argument("--full", action="store_true",
                   help="print every check (preset and token count), not one row per op and implementation; the "
                        "failed checks are printed in full either way, and --json holds every check")
    v.add_argument("--progress-lines", action="store_true", help=argparse.SUPPRESS)  # a child's reports
    v.set_defaults(func=cmd_verify)
    b = sub.add_parser("bench", help="time moekit's experts against the peers on this GPU (CUDA graphs)")
    experts.add_arguments(b)
    b.add_argument("--weights", default="bf16",
                   help="bf16 (default: against every peer), or low-bit experts against moekit bf16 and torch "
                        "grouped_mm: 'native' (gpt-oss MXFP4, qwen3 NVFP4, deepseek-v3/kimi-k2 FP8 W8A8) or one of "
                        "mxfp4, nvfp4, fp8_block, fp8_channel")
    b.add_argument("--plot", type=_argtypes.new_file, help="save a PNG (one per preset when several: NAME_preset.png)")
    b.add_argument("--metric", choices=["us", "floor"], default="us", help="plot time, or %% of the floor")
    b.set_defaults(func=cmd_bench, out=Path("moekit-bench"))  # results here, not into a source tree
    for action in b._actions:  # (the script's help names its own defaults)
        if action.dest == "out":
            action.help = "folder for NAME.json and NAME.md (default: ./moekit-bench)"
        elif action.dest == "name":
            action.help = "the result files' name (default: experts; lowbit with --weights)"
        elif action.dest == "presets":
            action.help += f"; with --weights: {' '.join(lowbit.DEFAULT_PRESETS)}"
    t = sub.add_parser("tune", help="measure the experts' block configurations on this GPU (writes a table)",
                       description=tune.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_arguments(t)
    t.set_defaults(func=lambda args: tune.run(t, args))
    e = sub.add_parser("explain", help="which implementation serves each op, and why",
                       description="For each preset and token count: which router tier, routing and experts backend "
                       "serve the call on this machine, the block configuration and kernels launched, and why the "
                       "other candidates were passed over. Nothing is launched.")
    e.add_argument("--preset", nargs="+", type=_argtypes.preset_name,
                   help="presets to explain (default: all; with --weights native, those with a checkpoint format)")
    e.add_argument("--tokens", nargs="+", type=_argtypes.token_count, default=[1, 16, 128, 4096],
                   help="token counts (default: 1 16 128 4096)")
    e.add_argument("--weights", default="bf16",
                   help="bf16 (default), 'native' (each preset's checkpoint format) or one of mxfp4, nvfp4, fp8_block, "
                        "fp8_channel")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the activations' dtype (and the weights' where they are dense)")
    e.add_argument("--batch-invariant", action="store_true", help="explain batch-invariant mode's choices")
    e.set_defaults(func=cmd_explain)
    sub.add_parser("presets", help="the table of model presets").set_defaults(func=cmd_presets)
    return p


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on the CPU through numpy
    if _triton.interpreting():
        _interpreter.speed_up()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # the environment switches, read once here: a bad value is a usage error, not a failure of every check
        _invariant.enabled(), gate.enabled()
    except ValueError as exc:
        parser.error(str(exc))
    if args.command is None:  # (a command is missing: the usage, and the status of a usage error)
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into a reader that stopped (`| head`): no traceback, but not a success
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
