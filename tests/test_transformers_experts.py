"""experts_implementation="moekit" against transformers' own experts forwards, for every experts module that
transformers builds through its ExpertsInterface (found in its source, so a new family is tested the day it
appears), at tiny sizes on the CPU, plus whole models (Qwen3-MoE, gpt-oss) and transformers' expert-parallel
sentinel ids."""

import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

from moekit.integrations import transformers_experts  # noqa: E402
from moekit.integrations.transformers import NAME  # noqa: E402 - importing it registers moekit
from moekit.metrics import EXPERTS_TOL, Tolerance, check_close  # noqa: E402

FP32 = Tolerance(1e-4, 1e-5)
# Tiny sizes for whatever each family calls them (None or per-layer lists included).
SIZES = {"hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
         "num_experts": 8, "n_routed_experts": 8, "num_local_experts": 8, "moe_num_experts": 8,
         "num_experts_per_tok": 2, "ffn_hidden_size": 32, "moe_ffn_hidden_size": 32, "top_k_experts": 2}
_DECORATED = re.compile(r"@use_experts_implementation(?:\([^)]*\))?\s*\nclass (\w+)")


def _families() -> list[tuple[str, str]]:
    root = Path(transformers.__file__).parent / "models"
    return sorted((path.parent.name, cls) for path in root.glob("*/modeling_*.py")
                  for cls in _DECORATED.findall(path.read_text()))


def _configs(cfg, seen=None):
    seen = seen if seen is not None else set()
    if id(cfg) not in seen:
        seen.add(id(cfg))
        yield cfg
        for value in vars(cfg).values():
            if isinstance(value, transformers.PretrainedConfig):
                yield from _configs(value, seen)


def _experts_module(family: str, cls_name: str):
    """The family's experts module at tiny sizes, or pytest.skip with why it cannot be built that way."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(mod, cls_name)
    try:
        cfg = transformers.AutoConfig.for_model(family)
    except ValueError:  # a family without an AutoConfig entry: its own config class
        conf = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        cfg = next(v for v in vars(conf).values()
                   if isinstance(v, type) and issubclass(v, transformers.PretrainedConfig) and v.__module__ == conf.__name__)()
    for c in _configs(cfg):
        for key, value in SIZES.items():
            current = vars(c).get(key, "absent")
            if isinstance(current, int) or current is None:
                setattr(c, key, value)
            elif isinstance(current, (list, tuple)) and current and isinstance(current[0], int):
                setattr(c, key, type(current)([value] * len(current)))
    kwargs = {"layer_idx": 0} if "layer_idx" in inspect.signature(cls.__init__).parameters else {}
    errors = []
    for c in _configs(cfg):  # composite models build their experts from a sub-config
        try:
            module = cls(c, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the next sub-config may be the experts'
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if sum(p.numel() for p in module.parameters()) > 5_000_000:
            pytest.skip(f"{cls_name} stays large at the tiny sizes")
        return module
    pytest.skip(f"cannot build {cls_name} from its default config at tiny sizes: {errors[-1][:200]}")


def _inputs(module, T=9, k=2, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    H = next(p for n, p in module.named_parameters() if n.startswith("down_proj") and p.dim() == 3)
    hidden = H.shape[2] if getattr(module, "is_transposed", False) else H.shape[1]  # down_proj: [E, H, I] or [E, I, H]
    x = torch.randn(T, hidden, generator=gen)
    ids = torch.stack([torch.randperm(module.num_experts, generator=gen)[:k] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, k, generator=gen), -1)


def _run(module, impl, *args):
    module.config._experts_implementation = impl
    with torch.no_grad():
        return module(*args)


@pytest.mark.parametrize("family,cls_name", _families(), ids=[f"{f}-{c}" for f, c in _families()])
def test_every_family_matches_transformers(family, cls_name):
    # "eager" is the family's own forward; what moekit cannot serve goes to grouped_mm with one warning
    module = _experts_module(family, cls_name)
    args = _inputs(module)
    try:
        expect = _run(module, "eager", *args)
    except (IndexError, RuntimeError):  # a family whose experts take one route per row (ergo)
        args = _inputs(module, k=1)
        expect = _run(module, "eager", *args)
    plan = transformers_experts._plan(module)
    if isinstance(plan, str):
        transformers_experts._WARNED.discard(cls_name)
        with pytest.warns(RuntimeWarning, match=f"moekit cannot serve {cls_name}"):
            got = _run(module, NAME, *args)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = _run(module, NAME, *args)
    assert got.shape == expect.shape and got.dtype == expect.dtype
    check_close(f"{family} {cls_name}", got, expect, FP32)


def test_the_families_moekit_serves():
    # the common layouts must not silently fall back: Qwen/Mixtral/DeepSeek's [gate; up] with SiLU, gpt-oss's swiglu
    for family, cls_name, activation in [("qwen3_moe", "Qwen3MoeExperts", "silu_and_mul"),
                                         ("mixtral", "MixtralExperts", "silu_and_mul"),
                                         ("deepseek_v3", "DeepseekV3Experts", "silu_and_mul"),
                                         ("gpt_oss", "GptOssExperts", "swiglu_oai")]:
        plan = transformers_experts._plan(_experts_module(family, cls_name))
        assert not isinstance(plan, str) and plan[2] == activation, (family, plan)


@torch.no_grad()
def test_weights_are_used_as_stored_or_prepared_once():
    qwen = _experts_module("qwen3_moe", "Qwen3MoeExperts")
    w13, w2, _ = transformers_experts._plan(qwen)
    assert w13 is qwen.gate_up_proj and w2 is qwen.down_proj           # [E, 2I, H] as stored: no copy
    oss = _experts_module("gpt_oss", "GptOssExperts")                   # transposed [E, H, 2I]: one copy, cached
    args = _inputs(oss)
    first = transformers_experts._plan(oss)
    assert first[0].shape == (8, 64, 64) and first[0].is_contiguous()
    assert transformers_experts._plan(oss) is first
    with torch.no_grad():
        oss.gate_up_proj.mul_(2.0)                                      # an in-place change is seen
    assert transformers_experts._plan(oss) is not first
    check_close("gpt-oss after an in-place change", _run(oss, NAME, *args), _run(oss, "eager", *args), FP32)



@torch.no_grad()
def test_a_new_view_of_the_same_weights_each_forward_reuses_the_plan():
    # transformers' expert parallelism sets the experts' weights to DTensor.to_local() inside each forward: a new view
    # object of the same local shard every time, and gpt-oss's transposed stack was copied again on every call
    oss = _experts_module("gpt_oss", "GptOssExperts")
    shard_up, shard_down = oss.gate_up_proj.detach().clone(), oss.down_proj.detach().clone()
    del oss.gate_up_proj, oss.down_proj
    oss.gate_up_proj, oss.down_proj = shard_up.view(shard_up.shape), shard_down.view(shard_down.shape)
    first = transformers_experts._plan(oss)
    oss.gate_up_proj, oss.down_proj = shard_up.view(shard_up.shape), shard_down.view(shard_down.shape)
    assert transformers_experts._plan(oss) is first
    shard_up.mul_(2.0)                                                  # written through the shard: seen
    oss.gate_up_proj = shard_up.view(shard_up.shape)
    assert transformers_experts._plan(oss) is not first

def test_expert_parallel_sentinels_contribute_nothing():
    # transformers' EP convention: ids at or past num_experts belong to other ranks
    module = _experts_module("qwen3_moe", "Qwen3MoeExperts")
    x, ids, weights = _inputs(module)
    ids[::2, 1] = module.num_experts
    module._is_expert_parallel = True
    check_close("EP sentinels", _run(module, NAME, x, ids, weights), _run(module, "grouped_mm", x, ids, weights), FP32)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_whole_models_select_moekit(family):
    from transformers import AutoModelForCausalLM

    cfg = transformers.AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                            **({"num_local_experts": 8} if family == "gpt_oss" else {"num_experts": 8}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    ids = torch.randint(0, 97, (2, 11))
    calls = []
    served = transformers_experts.experts_forward
    moe.ExpertsInterface.register(NAME, lambda *a: calls.append(1) or served(*a))
    try:
        with torch.no_grad():
            model.set_experts_implementation("grouped_mm")
            expect = model(ids).logits
            model.set_experts_implementation(NAME)
            got = model(ids).logits
    finally:
        moe.ExpertsInterface.register(NAME, served)
    assert len(calls) == 2                                              # one call per MoE layer
    check_close(f"{family} logits", got, expect, FP32)


def _real_size(family, cls_name, **sizes):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = transformers.AutoConfig.for_model(family, **sizes)
    with torch.device("cuda"):
        module = getattr(mod, cls_name)(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=sizes["hidden_size"] ** -0.5)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("family,cls_name,sizes", [
    ("qwen3_moe", "Qwen3MoeExperts", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                          num_experts_per_tok=8)),          # qwen3-30b-a3b
    ("gpt_oss", "GptOssExperts", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                      num_experts_per_tok=4)),                # gpt-oss-20b: transposed, biases
])
def test_gpu_real_sizes_eager_graph_and_compile(family, cls_name, sizes):
    # against the family's own forward in float64 (two bf16 paths differ from each other by both roundings)
    import copy

    module = _real_size(family, cls_name, **sizes)
    twin = copy.deepcopy(module).double()
    k, E, H = sizes["num_experts_per_tok"], module.num_experts, sizes["hidden_size"]

    def inputs(T, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :k]
        w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1).bfloat16()
        return torch.randn(T, H, device="cuda", generator=g).bfloat16(), ids, w

    def reference(x, ids, w):
        return _run(twin, "eager", x.double(), ids, w.double())

    bf16 = EXPERTS_TOL[torch.bfloat16]
    for T in (1, 16, 300):
        args = inputs(T, T)
        check_close(f"{family} T={T}", _run(module, NAME, *args), reference(*args), bf16)
    # CUDA graph: captured once (its first eager call prepared the weights), replayed with new inputs
    x, ids, w = inputs(16, 1)
    module.config._experts_implementation = NAME
    with torch.no_grad():
        module(x, ids, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(x, ids, w)
        for seed in (2, 3):
            new = inputs(16, seed)
            for dst, src in zip((x, ids, w), new):
                dst.copy_(src)
            graph.replay()
            check_close(f"{family} graph replay", out, reference(*new), bf16)
    module.config._experts_implementation = NAME
    compiled = torch.compile(module, fullgraph=True)
    args = inputs(16, 4)
    with torch.no_grad():
        check_close(f"{family} compiled", compiled(*args), reference(*args), bf16)


def test_the_prepared_stack_follows_the_module():
    # a cast, a replaced weight or a copy of the module prepares again; forget() after a .data write
    import copy

    oss = _experts_module("gpt_oss", "GptOssExperts")
    args = _inputs(oss)
    _run(oss, NAME, *args)
    oss.to(torch.bfloat16)                                              # same parameters, cast in place
    x16 = [a.bfloat16() if a.is_floating_point() else a for a in args]
    check_close("gpt-oss in bf16", _run(oss, NAME, *x16).float(), _run(oss, "eager", *x16).float(),
                Tolerance(2e-2, 1e-2))
    twin = copy.deepcopy(oss)
    assert twin.__dict__.get("_moekit_plan") is None                    # the copy prepares its own
    oss.to(torch.float32)
    oss.gate_up_proj.data[0] *= -1.0                                    # no version counter sees this
    transformers_experts.forget(oss)
    check_close("gpt-oss after forget()", _run(oss, NAME, *args), _run(oss, "eager", *args), FP32)


def test_compiles_fullgraph_after_an_eager_call():
    module = _experts_module("qwen3_moe", "Qwen3MoeExperts")
    args = _inputs(module)
    module.config._experts_implementation = NAME
    with torch.no_grad():
        eager = module(*args)                                           # prepares the plan
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, backend="eager")
        check_close("compiled", compiled(*args), eager, FP32)


def test_a_replacement_weight_at_a_freed_address_is_prepared_again():
    # the cache once knew a weight by its address, shape and version alone: a replacement allocated where the old
    # one was freed (routine for CUDA's caching allocator) reused the old weights' transposed copy
    oss = _experts_module("gpt_oss", "GptOssExperts")
    args = _inputs(oss)
    E, H, two_i = oss.gate_up_proj.shape
    for _ in range(3):
        _run(oss, NAME, *args)
        oss._parameters["gate_up_proj"] = None  # freed: its replacement may land at the same address
        oss.gate_up_proj = nn.Parameter(torch.randn(E, H, two_i) * 0.2)
        check_close("gpt-oss after a replaced weight", _run(oss, NAME, *args), _run(oss, "eager", *args), FP32)


def test_transposed_experts_pass_gradients_to_their_weights():
    # gpt-oss's prepared copy is detached: with gradients asked, the parameters themselves (as views) must serve
    oss = _experts_module("gpt_oss", "GptOssExperts")
    x, ids, weights = _inputs(oss)
    grads = {}
    for impl in ("eager", NAME):
        oss.zero_grad(set_to_none=True)
        oss.config._experts_implementation = impl
        oss(x, ids, weights).square().sum().backward()
        grads[impl] = {n: p.grad for n, p in oss.named_parameters()}
    for name, want in grads["eager"].items():
        assert grads[NAME][name] is not None, f"no gradient reached {name}"
        check_close(f"gpt-oss grad of {name}", grads[NAME][name], want, Tolerance(1e-4, 1e-5))


def test_int64_ids_past_int32_are_no_expert():
    # a cast wrapped 2**32 + 1 into expert 1; transformers' ids are int64
    module = _experts_module("qwen3_moe", "Qwen3MoeExperts")
    x, ids, weights = _inputs(module)
    far, none = ids.clone(), ids.clone()
    far[0, 0], none[0, 0] = 2 ** 32 + 1, module.num_experts  # the same: another rank's, or nobody's
    module._is_expert_parallel = True
    assert torch.equal(_run(module, NAME, x, far, weights), _run(module, NAME, x, none, weights))
