"""PEFT LoRA adapters on MoE experts (LoraConfig(target_parameters=...)) converted to moekit's ExpertsLoRA, against
PEFT's own forward, on tiny Qwen3-MoE and gpt-oss models built from their configs (no download); and the
transformers experts backend serving a PEFT-wrapped model with the adapter's factors, never a folded weight."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moekit.experts import fused_experts  # noqa: E402
from moekit.integrations import peft as moekit_peft  # noqa: E402
from moekit.integrations import transformers_experts  # noqa: E402
from moekit.integrations.transformers import NAME  # noqa: E402 - importing it registers moekit
from moekit.metrics import Tolerance, check_close  # noqa: E402

FP32 = Tolerance(1e-4, 1e-5)
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model(family):
    from transformers import AutoModelForCausalLM

    experts = {"num_local_experts": 8} if family == "gpt_oss" else {"num_experts": 8}
    cfg = transformers.AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, num_experts_per_tok=2, moe_intermediate_size=32, **experts)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    return model


def _adapt(model, adapters=(("first", 4, 8), ("second", 8, 4))):
    """A PEFT model with LoRA adapters (name, r, lora_alpha) on both expert stacks, B non-zero (PEFT's default
    zeros would make every check pass trivially)."""
    first, *rest = adapters
    config = lambda r, alpha: peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=[],  # noqa: E731
                                              target_parameters=TARGETS, init_lora_weights=False)
    model = peft.get_peft_model(model, config(*first[1:]), adapter_name=first[0])
    for name, r, alpha in rest:
        model.add_adapter(name, config(r, alpha))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape) * 0.3)
    return model.eval()


def _experts(model):
    """(name of each wrapped experts module, the wrapper, the experts module under it)."""
    out = []
    for name, wrapper in moekit_peft.convert(model).items():
        out.append((name, model.get_submodule(name), moekit_peft.unwrap(model.get_submodule(name))[0]))
    return out


def _route(experts, T, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:k] for _ in range(T)])
    return ids, torch.softmax(torch.randn(T, k, generator=gen), -1)


def _peft_experts(wrapper, experts, adapter, x, ids, weights):
    """PEFT's forward of the experts (adapter folded into the weight, transformers' eager experts)."""
    wrapper.set_adapter(adapter) if hasattr(wrapper, "set_adapter") else None
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        return wrapper(x, ids, weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_converted_adapters_match_peft_per_token(family):
    model = _adapt(_model(family))
    found = moekit_peft.convert(model)
    assert len(found) == 2                                               # one experts module per layer
    for name, lora in found.items():
        wrapper = model.get_submodule(name)
        experts = moekit_peft.unwrap(wrapper)[0]
        assert lora.num_adapters == 2 and lora.w13_a.shape[2] == 8           # ranks 4 and 8: padded to 8
        assert lora.scaling.tolist() == [2.0, 0.5]                          # lora_alpha / r
        T = 9
        H = lora.w13_a.shape[3]
        x = torch.randn(T, H)
        ids, weights = _route(experts, T)
        lora_ids = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 0], dtype=torch.int32)
        expect = torch.empty(T, H)
        for i, adapter in enumerate(["first", "second"]):
            rows = lora_ids == i
            model.base_model.set_adapter(adapter)
            expect[rows] = _peft_experts(wrapper, experts, adapter, x, ids, weights)[rows]
        w13, w2 = experts.gate_up_proj, experts.down_proj
        if experts.is_transposed:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        act = "swiglu_oai" if family == "gpt_oss" else "silu_and_mul"
        bias = dict(w13_bias=experts.gate_up_proj_bias, w2_bias=experts.down_proj_bias) if experts.has_bias else {}
        with torch.no_grad():
            got = fused_experts(x, w13.detach(), w2.detach(), weights.float(), ids.int(), activation=act, lora=lora,
                                lora_ids=lora_ids, backend="torch", **bias)
            got_triton = fused_experts(x, w13.detach(), w2.detach(), weights.float(), ids.int(), activation=act,
                                       lora=lora, lora_ids=lora_ids, backend="triton", **bias)
        check_close(f"{family} {name} torch", got, expect, FP32)
        check_close(f"{family} {name} triton", got_triton, expect, FP32)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_transformers_backend_serves_a_peft_model_with_the_factors(family, monkeypatch):
    model = _adapt(_model(family), adapters=(("only", 4, 8),))
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        model.base_model.model.set_experts_implementation("grouped_mm")
        expect = model(ids).logits
        model.base_model.model.set_experts_implementation(NAME)
        seen = []
        real = transformers_experts._peft_lora
        monkeypatch.setattr(transformers_experts, "_peft_lora", lambda m: seen.append(real(m)) or seen[-1])
        folded = []
        real_fold = peft.tuners.lora.layer._LoraFactorsProxy.forward
        monkeypatch.setattr(peft.tuners.lora.layer._LoraFactorsProxy, "forward",
                            lambda self, W: folded.append(1) or real_fold(self, W))
        got = model(ids).logits
    assert len(seen) == 2 and all(lora is not None and lora.w13_a is not None and lora.w2_a is not None
                                  for lora in seen)                      # the adapter ran as moekit's LoRA
    # one fold per parameter and layer: torch's check when PEFT registers the parametrization; moekit reads none
    assert len(folded) == 2 * 2
    check_close(f"{family} logits", got, expect, FP32)


def test_several_active_adapters_are_served_on_the_weight_peft_merged():
    model = _adapt(_model("qwen3_moe"))
    model.base_model.set_adapter(["first", "second"])
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        model.base_model.model.set_experts_implementation("grouped_mm")
        expect = model(ids).logits
        model.base_model.model.set_experts_implementation(NAME)
        got = model(ids).logits
    check_close("two adapters summed by PEFT", got, expect, FP32)


def test_conversion_refuses_what_it_cannot_take():
    model = _adapt(_model("qwen3_moe"))
    name, wrapper, experts = _experts(model)[0]
    with pytest.raises(ValueError, match=r"adapters \['third'\] are on none"):
        moekit_peft.experts_lora(wrapper, adapters=["third"])
    with pytest.raises(ValueError, match="is not a PEFT ParamWrapper"):
        moekit_peft.experts_lora(experts)
    lora = moekit_peft.experts_lora(wrapper, adapters=["second"], dtype=torch.float16)
    assert lora.num_adapters == 1 and lora.dtype == torch.float16 and lora.w2_a.shape[2] == 8


def test_an_adapter_scaled_differently_per_parameter_converts_exactly():
    # rank_pattern gives down_proj rank 2 (scaling 8 / 2 = 4) against gate_up_proj's 4 (scaling 2): refused before,
    # though moekit's one scaling per adapter can take it with the ratio in down_proj's B
    model = _model("qwen3_moe")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=TARGETS, init_lora_weights=False,
                          rank_pattern={"down_proj": 2})
    model = peft.get_peft_model(model, cfg, adapter_name="pattern").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape) * 0.3)
    name, wrapper, experts = _experts(model)[0]
    lora = moekit_peft.experts_lora(wrapper)
    assert lora.scaling.tolist() == [4.0]
    T, H = 7, lora.w13_a.shape[3]
    x = torch.randn(T, H)
    ids, weights = _route(experts, T)
    expect = _peft_experts(wrapper, experts, "pattern", x, ids, weights)
    with torch.no_grad():
        got = fused_experts(x, experts.gate_up_proj.detach(), experts.down_proj.detach(), weights.float(), ids.int(),
                            lora=lora, lora_ids=torch.zeros(T, dtype=torch.int32), backend="torch")
    check_close("rank_pattern", got, expect, FP32)


@pytest.mark.parametrize("flow", ["merge_and_unload", "merge_adapter", "disable_after_merge", "unmerge"])
def test_peft_merges_reach_a_transposed_stacks_prepared_copy(flow):
    # PEFT merges through param.data, which bumps no version counter: gpt-oss's transposed copy kept serving the
    # weights from before (the whole adapter's effect lost, or kept after PEFT took it out)
    model = _adapt(_model("gpt_oss"), adapters=(("only", 4, 8),))
    ids = torch.randint(0, 97, (2, 7))
    inner = model.base_model.model

    def logits(impl):
        inner.set_experts_implementation(impl)
        return model(ids).logits

    with torch.no_grad():
        adapted = logits("grouped_mm")
        with model.disable_adapter():
            base = logits("grouped_mm")
        if flow in ("merge_and_unload", "merge_adapter"):
            logits(NAME)  # the copy is made of the stored weights, the adapter beside them
            if flow == "merge_adapter":
                model.merge_adapter()
                got, expect = logits(NAME), adapted
            else:
                merged = model.merge_and_unload()
                merged.set_experts_implementation(NAME)
                got, expect = merged(ids).logits, adapted
        else:
            model.merge_adapter()
            logits(NAME)  # the copy is made of the merged weights
            if flow == "unmerge":
                model.unmerge_adapter()
            with model.disable_adapter():
                got, expect = logits(NAME), base
    check_close(f"gpt-oss after {flow}", got, expect, FP32)


def test_patch_leaves_peft_wrapped_blocks_alone():
    # the converters read the stacks through PEFT's wrappers (AttributeError), and would drop the adapters
    from moekit.integrations.transformers import patch

    model = _adapt(_model("qwen3_moe"), adapters=(("only", 4, 8),))
    report = patch(model)
    assert not report.replaced and len(report.left_alone) == 2
    assert all("PEFT adapters wrap its experts" in why for _, why in report.left_alone)
