"""Error measures and accuracy budgets against the float64 references, shared by the in-library gate,
`moekit verify`, the benchmarks and the tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from . import reference


@dataclass(frozen=True)
class Tolerance:
    """Budget of a fast path against its float64 reference.

    max_rel: max |got - ref| / max |ref|;  rms_rel: ||got - ref||_F / ||ref||_F.
    """

    max_rel: float
    rms_rel: float


# Budgets against float64. Experts: relative Frobenius error of the budgets (bf16 5e-3; fp32 1e-5 on
# the RMS; fp16 keeps activations and per-slot outputs in fp16); max_rel is looser: one element's rounding.
EXPERTS_TOL = {torch.float32: Tolerance(1e-4, 1e-5), torch.float16: Tolerance(2e-2, 5e-3),
               torch.bfloat16: Tolerance(2e-2, 5e-3)}
# fp32 sums of the same E4M3 products; rare rounding flips of an activation code (or of h's, requantized between the
# GEMMs) move single elements, and at small sizes the RMS too: 1.4e-2 for a correct W4A8 call of 7 tokens (H=256), 2-4e-3
# at real sizes (results/lowbit.md). So an output 1-3% off passes this budget; the gate checks small cases with it.
W8A8_TOL = Tolerance(3e-2, 3e-2)
LOGITS_TOL = Tolerance(max_rel=1e-4, rms_rel=1e-5)  # router logits in fp32
WEIGHT_TOL = 1e-4  # absolute, on routing weights in [0, scaling]


def experts_tolerance(dtype: torch.dtype = torch.bfloat16, w8a8: bool = False) -> Tolerance:
    """The budget of an experts call against its float64 reference, as the gate and `moekit verify` set it: W8A8_TOL
    for FP8 activations (W8A8, W4A8; against the W8A8 reference), else EXPERTS_TOL of the activations' dtype (bf16
    weights, and 4-bit W4A16 against float64 on its dequantized weights)."""
    return W8A8_TOL if w8a8 else EXPERTS_TOL[dtype]


def within(tol: Tolerance, max_rel: float | None, rms_rel: float | None) -> bool:
    """Both errors within ``tol``; an error not measured (None) is not held against it."""
    return (max_rel is None or max_rel <= tol.max_rel) and (rms_rel is None or rms_rel <= tol.rms_rel)


@dataclass
class CheckResult:
    """One check of an implementation against its reference (a row of `moekit verify`'s table). ``max_budget`` and
    ``rms_budget``: what ``max_rel`` and ``rms_rel`` were held to (None: not a budget of this check; routes hold the
    weights' absolute error to WEIGHT_TOL, invariance checks hold bits, a budget of 0)."""

    op: str
    impl: str
    preset: str
    tokens: int
    max_rel: float = 0.0
    rms_rel: float = 0.0
    agree: float = 1.0
    ok: bool = True
    detail: str = ""
    max_budget: float | None = None
    rms_budget: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def score_values(r: CheckResult, got, ref, tol: Tolerance, written_in_place: bool = True) -> CheckResult:
    """Fill ``r`` with the errors of ``got`` against ``ref`` and whether they are within ``tol``."""
    r.max_rel, r.rms_rel = rel_errors(got, ref)
    r.max_budget, r.rms_budget = tol.max_rel, tol.rms_rel
    r.ok = written_in_place and r.max_rel <= tol.max_rel and r.rms_rel <= tol.rms_rel
    r.detail = "" if written_in_place else "out= not written in place"
    return r


def score_routes(r: CheckResult, tw, tid, ref_w, ref_ids, separable, num_experts: int) -> CheckResult:
    """Fill ``r`` with the top-k agreement on separable tokens, the weight error there, and whether
    both (and every id in [0, num_experts)) are within budget."""
    r.agree, r.max_rel = routes_agree(tw, tid, ref_w, ref_ids, separable)
    r.max_budget = WEIGHT_TOL
    ids_valid = tid.numel() == 0 or bool((tid.min() >= 0) & (tid.max() < num_experts))
    r.ok = r.agree == 1.0 and r.max_rel <= WEIGHT_TOL and ids_valid
    return r


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max_rel, rms_rel) of ``got`` against ``ref``; inf when ``got`` has NaN/Inf where ``ref`` is finite, or is not
    the same NaN or infinity where ``ref`` is not finite."""
    g = got.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if g.shape != r.shape:
        raise ValueError(f"shape mismatch: got {tuple(g.shape)}, reference {tuple(r.shape)}")
    if g.numel() == 0:
        return 0.0, 0.0
    finite = torch.isfinite(r)
    if not torch.isfinite(g[finite]).all():
        return float("inf"), float("inf")
    g_off, r_off = g[~finite], r[~finite]
    if not ((g_off == r_off) | (g_off.isnan() & r_off.isnan())).all():
        return float("inf"), float("inf")
    if not finite.any():
        return 0.0, 0.0
    diff = (g - r)[finite]
    rf = r[finite]
    scale_max = rf.abs().max().item() or 1.0
    scale_rms = rf.norm().item() or 1.0
    return diff.abs().max().item() / scale_max, diff.norm().item() / scale_rms


def check_close(what: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> None:
    """Raise AssertionError with both errors when ``got`` is outside ``tol`` of ``ref``."""
    max_rel, rms_rel = rel_errors(got, ref)
    if not (max_rel <= tol.max_rel and rms_rel <= tol.rms_rel):
        raise AssertionError(f"{what}: max_rel={max_rel:.3e} (budget {tol.max_rel:.1e}), "
                             f"rms_rel={rms_rel:.3e} (budget {tol.rms_rel:.1e})")


def separable_tokens(logits64: torch.Tensor, top_k: int, method: str, *, correction_bias=None,
                     num_groups: int = 1, topk_groups: int = 1, rel_gap: float = 1e-4,
                     **_unused) -> torch.Tensor:
    """bool [T]: tokens whose choice is not a near-tie in float64.

    A token is separable when the gap between its k-th and (k+1)-th choice score (and, for
    grouped routing, between the last kept and the first dropped group score) exceeds
    ``rel_gap * max |logit|`` of that token. Only on those tokens must fast paths agree exactly.
    """
    scores = reference.selection_key(reference.choice_scores(logits64, method, correction_bias))
    num_tokens, num_experts = scores.shape
    scale = logits64.abs().nan_to_num(posinf=0.0).amax(dim=-1).clamp_min(1e-30)
    ok = torch.ones(num_tokens, dtype=torch.bool, device=scores.device)
    if method == "sigmoid_grouped" and topk_groups < num_groups:
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        g = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
        g = torch.sort(g, dim=-1, descending=True).values
        ok &= (g[:, topk_groups - 1] - g[:, topk_groups]) > rel_gap * scale
        _, ids = reference.route(logits64, top_k, method, correction_bias=correction_bias,
                                 num_groups=num_groups, topk_groups=topk_groups)
        kept_groups = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
        kept_groups.scatter_(1, ids // (num_experts // num_groups), True)
        # Experts of dropped groups cannot compete; gap is taken among the kept groups' experts.
        kept = kept_groups.repeat_interleave(num_experts // num_groups, dim=1)
        scores = scores.masked_fill(~kept, -torch.inf)
    if top_k < num_experts:
        s = torch.sort(scores, dim=-1, descending=True).values
        gap = s[:, top_k - 1] - s[:, top_k]
        ok &= gap.nan_to_num(nan=0.0) > rel_gap * scale
    return ok


def routes_agree(weights: torch.Tensor, ids: torch.Tensor, ref_weights: torch.Tensor, ref_ids: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[float, float]:
    """(fraction of tokens whose expert SET equals the reference's, max |weight error| on those).

    Slots are compared after sorting by expert id, so a swapped order of two chosen experts
    with equal scores does not count as a disagreement. ``mask`` restricts to some tokens.
    """
    ids = ids.long().cpu()
    ref_ids = ref_ids.long().cpu()
    w_sorted = torch.gather(weights.double().cpu(), 1, ids.argsort(dim=1))
    r_sorted = torch.gather(ref_weights.double().cpu(), 1, ref_ids.argsort(dim=1))
    same = (ids.sort(dim=1).values == ref_ids.sort(dim=1).values).all(dim=1)
    if mask is not None:
        mask = mask.cpu()
        same, w_sorted, r_sorted = same[mask], w_sorted[mask], r_sorted[mask]
    if same.numel() == 0:
        return 1.0, 0.0
    agree = same.double().mean().item()
    err = (w_sorted[same] - r_sorted[same]).abs()
    finite = torch.isfinite(r_sorted[same])
    werr = err[finite].max().item() if finite.any() else 0.0
    return agree, werr
