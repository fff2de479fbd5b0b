"""moekit inside Hugging Face transformers models built from their own config classes (no
download): patched models give the original outputs layer by layer and the same greedy tokens."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.integrations.transformers import MoekitBlock, patch, unpatch  # noqa: E402
from moekit.metrics import Tolerance, check_close  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)


def _qwen3():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                              mlp_only_layers=[], head_dim=16))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                          head_dim=16, layer_types=["full_attention"] * 2))


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                  n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                                                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=16, routed_scaling_factor=2.5))


MODELS = [(_qwen3, "Qwen3MoeSparseMoeBlock"), (_mixtral, "MixtralSparseMoeBlock"), (_gpt_oss, "GptOssMLP"),
          (_deepseek_v3, "DeepseekV3MoE")]


def _randomize(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(0, 0.1)


@pytest.mark.parametrize("make,block", MODELS, ids=[b for _, b in MODELS])
def test_patched_model_matches_the_original(make, block):
    try:
        model = make().eval()
    except Exception as exc:  # a transformers version without this model or config field
        pytest.skip(f"cannot build {block}: {type(exc).__name__}: {exc}")
    _randomize(model)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        report = patch(model)
        assert [cls for _, cls in report.replaced] == [block] * 2, str(report)
        assert sum(isinstance(m, MoekitBlock) for m in model.modules()) == 2
        got = model(ids, output_hidden_states=True)
        for i, (a, b) in enumerate(zip(got.hidden_states, ref.hidden_states)):
            check_close(f"{block} hidden state {i}", a, b, Tolerance(1e-4, 1e-5))
        check_close(f"{block} logits", got.logits, ref.logits, Tolerance(1e-4, 1e-5))
        prompt = ids[:1, :4]
        patched_tokens = model.generate(prompt, max_new_tokens=36, do_sample=False)
        assert unpatch(model) == 2 and not any(isinstance(m, MoekitBlock) for m in model.modules())
        # Greedy decoding through the patched model is greedy decoding of the original: every token it picked is
        # the original model's argmax at that step, up to fp32 rounding (a near-tie may go either way, so the
        # tokens themselves need not be equal bit for bit on every machine).
        logits = model(patched_tokens).logits[0, prompt.shape[1] - 1:-1]
        picked = logits.gather(1, patched_tokens[0, prompt.shape[1]:, None])[:, 0]
        slack = 1e-4 * logits.abs().amax(dim=1)
    assert (picked >= logits.amax(dim=1) - slack).all(), f"{block}: a generated token is not the original's argmax"


def _with(make, **config):
    """``make``'s model with its config changed (its blocks built from the changed config)."""
    base = make().config
    for key, value in config.items():
        setattr(base, key, value)
    return type(make())(base)


ACTIVATION_CASES = [
    (_gpt_oss, {"swiglu_limit": 3.0}, "gpt-oss's swiglu clamped at another limit"),
    (_mixtral, {"hidden_act": "gelu"}, "Mixtral's experts on GELU"),
    (_qwen3, {"hidden_act": "gelu"}, "Qwen3-MoE's experts on GELU"),
    (_deepseek_v3, {"hidden_act": "relu"}, "DeepSeek-V3's experts and shared expert on ReLU"),
]


@pytest.mark.parametrize("make,config,why", ACTIVATION_CASES, ids=[c[2] for c in ACTIVATION_CASES])
def test_blocks_of_another_activation_are_left_alone(make, config, why):
    model = _with(make, **config).eval()
    _randomize(model)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    report = patch(model)
    assert not report.replaced and len(report.left_alone) == 2, report
    assert all("activation" in reason for _, reason in report.left_alone), report
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_a_models_dense_mlps_are_not_reported_as_moe_blocks():
    model = _with(_qwen3, mlp_only_layers=[0]).eval()  # layer 0 a dense Qwen3MoeMLP
    report = patch(model)
    assert [path for path, _ in report.replaced] == ["model.layers.1.mlp"] and not report.left_alone, report


@pytest.mark.parametrize("make,block", MODELS, ids=[b for _, b in MODELS])
def test_patched_blocks_report_router_logits(make, block):
    # transformers records router logits with hooks on its router modules, which a patched block does not call:
    # output_router_logits then failed in the auxiliary loss on an empty tuple
    try:
        model = make().eval()
    except Exception as exc:
        pytest.skip(f"cannot build {block}: {type(exc).__name__}: {exc}")
    _randomize(model)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True, labels=ids)
        patch(model)
        got = model(ids, output_router_logits=True, labels=ids)
    if ref.router_logits is None:
        pytest.skip(f"{block}'s model reports no router logits in this transformers")
    assert len(got.router_logits) == len(ref.router_logits) == 2
    for a, b in zip(got.router_logits, ref.router_logits):
        check_close(f"{block} router logits", a, b, Tolerance(1e-4, 1e-5))
    if getattr(ref, "aux_loss", None) is not None:
        check_close(f"{block} auxiliary loss", got.aux_loss, ref.aux_loss, Tolerance(1e-4, 1e-5))


def test_quantized_experts_are_left_alone():
    # transformers keeps FineGrainedFP8 experts as FP8 codes with block scales (*_scale_inv) and gpt-oss's MXFP4
    # experts as *_blocks/*_scales: patch() took the FP8 codes as values without their scales (outputs ~1e9 off),
    # and did not report the MXFP4 block at all
    from transformers import FineGrainedFP8Config, GptOssConfig, GptOssForCausalLM
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP

    model = _mixtral()
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"],
                            quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)))
    report = patch(model, dtype=torch.float32)
    assert not report.replaced and len(report.left_alone) == 2, report
    assert all("its experts are quantized" in why for _, why in report.left_alone), report

    cfg = GptOssConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=64, num_local_experts=4,
                       num_experts_per_tok=2, head_dim=16, layer_types=["full_attention"])
    model = GptOssForCausalLM(cfg)
    mlp = model.model.layers[0].mlp
    model.model.layers[0].mlp = Mxfp4GptOssMLP(mlp.router, Mxfp4GptOssExperts(cfg))
    report = patch(model)
    assert not report.replaced and report.left_alone[0][0] == "model.layers.0.mlp", report
    assert "Mxfp4GptOssMLP: its experts are quantized" in report.left_alone[0][1]


def test_expert_parallel_blocks_are_left_alone():
    # transformers' expert parallelism (DistributedConfig ep_size > 1) marks the experts and makes their weights
    # DTensors: patch() replaced such blocks and the forward failed on mixed Tensor/DTensor matmuls
    model = _qwen3()
    for layer in model.model.layers:
        layer.mlp.experts._is_expert_parallel = True
    report = patch(model)
    assert not report.replaced and len(report.left_alone) == 2, report
    assert all("expert-parallel" in why for _, why in report.left_alone), report
