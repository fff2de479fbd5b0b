"""Load one MoE layer of a gpt-oss checkpoint (safetensors, the MXFP4 layout of docs/formats.md) into a
:class:`moekit.FusedMoE`, reading only that layer's tensors.

Names (prefix ``model.layers.{i}.mlp.``): ``router.weight`` [E, H] bf16, ``router.bias`` [E],
``experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``experts.gate_up_proj_scales`` uint8
[E, 2I, H/32], ``experts.gate_up_proj_bias`` [E, 2I], ``experts.down_proj_blocks`` uint8
[E, H, I/32, 16], ``experts.down_proj_scales`` uint8 [E, H, I/32], ``experts.down_proj_bias`` [E, H].
The 2I axis is interleaved (row 2j gate j, row 2j+1 up j): moekit's swiglu_oai layout as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .. import presets
from ..formats import mxfp4
from ..layer import FusedMoE

NAN_SCALE_POLICIES = ("error", "warn", "allow")
EXPERT_KEYS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
               "down_proj_blocks", "down_proj_scales", "down_proj_bias")


def _files(source: Path) -> dict[str, Path]:
    """tensor name -> file holding it (from model.safetensors.index.json, else every *.safetensors)."""
    if source.is_file():
        candidates = [source]
    else:
        index = source / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {exc}") from None
            return {name: source / fname for name, fname in weight_map.items()}
        candidates = sorted(source.glob("*.safetensors"))
    if not candidates:
        raise FileNotFoundError(f"no .safetensors files in {source}")
    where = {}
    for path in candidates:
        with _opened(path) as f:
            where.update({name: path for name in f.keys()})
    return where


@contextlib.contextmanager
def _opened(path: Path):
    """safe_open, with errors that name the file (safetensors' own do not)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such checkpoint file (named by the checkpoint's index)") from None
    except (OSError, SafetensorError) as exc:  # a truncated or foreign file; other errors (memory) pass as they are
        raise ValueError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def _read(where: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Only the named tensors, each from its own file."""
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(f"checkpoint lacks {missing}")
    out = {}
    for path in sorted({where[n] for n in names}):
        with _opened(path) as f:
            out.update({n: f.get_tensor(n) for n in names if where[n] == path})
    return out


def _check_scales(name: str, scales: torch.Tensor, nan_scales: str) -> None:
    """A scale byte of 255 is E8M0's NaN: every weight of its block is NaN, and so is every output
    of a token routed to that expert. A released checkpoint holds none; one that does is broken."""
    bad = int((scales == mxfp4.NAN_SCALE).sum())
    if not bad or nan_scales == "allow":
        return
    what = (f"{name} holds {bad} NaN scales (E8M0 byte 255) of {scales.numel()}: the weights of those blocks are NaN, "
            "and so is the output of every token routed to them")
    if nan_scales == "error":
        raise ValueError(what + " (pass nan_scales='warn' or 'allow' to load it anyway)")
    warnings.warn(what, RuntimeWarning, stacklevel=3)


def _top_k(source: Path, default: int) -> int:
    config = (source if source.is_dir() else source.parent) / "config.json"
    if not config.exists():
        return default
    try:
        fields = json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config} is not valid JSON: {exc}") from exc
    top_k = fields.get("num_experts_per_tok", default) if isinstance(fields, dict) else None
    # int() would truncate 2.7 and read "2": a config that says either is not one to guess from
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{config}: num_experts_per_tok must be an int >= 1, got {top_k!r}"
                         if isinstance(fields, dict) else f"{config} must hold a JSON object")
    return top_k


def _check_layer_tensors(prefix: str, t: dict) -> None:
    """Each tensor of a layer against the shapes the router [E, H] and gate_up blocks [E, 2I, H/32, 16] imply, and
    its dtype, naming the checkpoint's tensor (the format's own checks cannot tell gate_up from down)."""
    def name(key):
        return prefix + key

    def check(key, shape, floating):
        v = t[name(key)]
        if floating != v.dtype.is_floating_point or (not floating and v.dtype != torch.uint8):
            want = "a floating dtype" if floating else "uint8"
            raise TypeError(f"{name(key)} must have {want}, got {v.dtype}")
        if tuple(v.shape) != shape:
            raise ValueError(f"{name(key)} must have shape {shape}, got {tuple(v.shape)}")

    router = t[name("router.weight")]
    if router.dim() != 2:
        raise ValueError(f"{name('router.weight')} must be [E, H], got shape {tuple(router.shape)}")
    E, H = router.shape
    check("router.weight", (E, H), True)
    blocks = t[name("experts.gate_up_proj_blocks")]
    if blocks.dim() != 4 or blocks.shape[1] % 2:
        raise ValueError(f"{name('experts.gate_up_proj_blocks')} must be [E={E}, 2I, H/32={H // 32}, 16] with 2I "
                         f"even, got shape {tuple(blocks.shape)}")
    two_i = blocks.shape[1]
    check("router.bias", (E,), True)
    check("experts.gate_up_proj_blocks", (E, two_i, H // 32, 16), False)
    check("experts.gate_up_proj_scales", (E, two_i, H // 32), False)
    check("experts.gate_up_proj_bias", (E, two_i), True)
    check("experts.down_proj_blocks", (E, H, two_i // 64, 16), False)
    check("experts.down_proj_scales", (E, H, two_i // 64), False)
    check("experts.down_proj_bias", (E, H), True)


def load_gpt_oss_layer(source: str | Path, layer_index: int, *, keep_mxfp4: bool = True,
                       dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                       nan_scales: str = "error") -> FusedMoE:
    """The MoE block of layer ``layer_index`` as a FusedMoE (router + top-4 softmax routing + experts).

    keep_mxfp4: keep the experts in MXFP4 (dequantized inside the kernels; the torch backend
    dequantizes on the fly) or dequantize them to ``dtype`` once. Shapes come from the tensors,
    top_k from config.json (default 4).
    nan_scales: what a scale byte of 255 (E8M0's NaN, which makes its whole block NaN) does:
    ``"error"`` (default: a ValueError naming the tensor; a released checkpoint has none),
    ``"warn"`` (a RuntimeWarning, then load), ``"allow"`` (load; NaN propagates as MXFP4 defines).
    Errors name the file: a missing, truncated or foreign file is a ValueError or FileNotFoundError
    with its path.
    """
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
        raise ValueError(f"layer_index must be an int >= 0, got {layer_index!r}")
    if nan_scales not in NAN_SCALE_POLICIES:
        raise ValueError(f"nan_scales must be one of {NAN_SCALE_POLICIES}, got {nan_scales!r}")
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such checkpoint file or directory")
    where = _files(source)
    prefix = f"model.layers.{layer_index}.mlp."
    names = [prefix + "router.weight", prefix + "router.bias"] + [prefix + "experts." + k for k in EXPERT_KEYS]
    t = _read(where, names)
    _check_layer_tensors(prefix, t)
    for key in ("gate_up_proj_scales", "down_proj_scales"):
        _check_scales(prefix + "experts." + key, t[prefix + "experts." + key], nan_scales)
    router_w = t[prefix + "router.weight"]
    num_experts, hidden = router_w.shape
    blocks13, scales13 = t[prefix + "experts.gate_up_proj_blocks"], t[prefix + "experts.gate_up_proj_scales"]
    inter = blocks13.shape[1] // 2
    spec = dataclasses.replace(presets.get("gpt-oss-20b"), name=f"gpt-oss layer {layer_index}", hidden_size=hidden,
                               intermediate_size=inter, num_experts=num_experts,
                               top_k=_top_k(source, presets.get("gpt-oss-20b").top_k))
    layer = FusedMoE(spec, dtype=dtype, device=device)
    q13 = mxfp4.from_gpt_oss(blocks13.to(device), scales13.to(device))
    q2 = mxfp4.from_gpt_oss(t[prefix + "experts.down_proj_blocks"].to(device),
                            t[prefix + "experts.down_proj_scales"].to(device))
    layer.load_weights(gate_weight=router_w, gate_bias=t[prefix + "router.bias"],
                       w13_bias=t[prefix + "experts.gate_up_proj_bias"], w2_bias=t[prefix + "experts.down_proj_bias"])
    if keep_mxfp4:
        layer.load_quantized_experts(q13, q2)
    else:
        layer.load_weights(w13=mxfp4.dequantize(q13, dtype), w2=mxfp4.dequantize(q2, dtype))
    return layer
