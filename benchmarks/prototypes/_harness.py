"""What the Gluon prototypes share: an offline sm_90 compile of their variants, and a GPU check that runs
a prototype and moekit's Triton kernel on the same aligned rows of a preset, then times both."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

CASES = (("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096))


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 2-D bf16 tensor with boxes of ``block``."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def persistent_grid(tiles: int, device: torch.device, programs: int | None) -> tuple[int]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return (min(tiles, programs or sms), )


def compile_offline(variants) -> None:
    """``variants``: (label, thunk) pairs; each thunk launches once on CPU tensors (compile only)."""
    import sm90_compile as S
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    driver.set_active(S._Sm90Driver())
    JITFunction.run = S._compile_only
    for label, thunk in variants:
        S.BUILT.clear()
        try:
            thunk()
        except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
            print(f"{label}: {type(exc).__name__}: {str(exc)[-1500:]}")
        for name, kernel in S.BUILT:
            print(f"{label} {name}: {S.resource_usage(kernel)} smem={kernel.metadata.shared}")


def aligned_case(name: str, T: int):
    """(spec, routes, sorted_pairs, block_expert, table config) for T tokens of a preset, 128-row blocks."""
    from moekit import _experts_triton as X, presets
    from moekit.expert_configs import choose
    spec = presets.get(name)
    ids = torch.rand(T, spec.num_experts, device="cuda").argsort(dim=1)[:, :spec.top_k].int().contiguous()
    _, sorted_pairs, block_expert = X.align(ids, None, spec.num_experts, 128)
    config, _ = choose(T, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size,
                       torch.device("cuda"), torch.bfloat16)
    print(f"{name} T={T}: table {config}", flush=True)
    return spec, ids, sorted_pairs, block_expert, config


def compare_and_time(label: str, run_ref, ref: torch.Tensor, run_new, new: torch.Tensor, rows, flops: float) -> None:
    """Poison ``new``, run both, compare ``rows`` of the outputs, time both in CUDA graphs."""
    from moekit.bench.timing import graph_time_us
    new.fill_(float("nan"))
    run_ref()
    run_new()
    torch.cuda.synchronize()
    a, b = new[rows].float(), ref[rows].float()
    err = ((a - b).abs().max() / b.abs().max()).item()
    t_ref, t_new = graph_time_us([run_ref]), graph_time_us([run_new])
    print(f"{label}: triton {t_ref:.1f} us ({flops / t_ref * 1e-6:.0f} TF/s)  gluon {t_new:.1f} us "
          f"({flops / t_new * 1e-6:.0f} TF/s)  max rel diff {err:.2e}", flush=True)

