"""The comparisons every test and `moekit verify` rest on: a wrong result must never compare as passing."""

import pytest
import torch

from moekit.metrics import EXPERTS_TOL, check_close, rel_errors

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("got, ref, passes, why", [
    ([1.0, 2.0], [1.0, 2.0], True, "equal"),
    ([1.0, NAN], [1.0, 2.0], False, "NaN where the reference is finite"),
    ([1.0, INF], [1.0, 2.0], False, "Inf where the reference is finite"),
    ([1.0, NAN], [1.0, INF], False, "NaN where the reference is +inf (it passed)"),
    ([1.0, -INF], [1.0, INF], False, "the other infinity"),
    ([1.0, INF], [1.0, INF], True, "the same infinity"),
    ([1.0, 2.0], [1.0, NAN], False, "a number where the reference is NaN (it passed)"),
    ([1.0, NAN], [1.0, NAN], True, "NaN where the reference is NaN"),
    ([NAN, INF], [NAN, INF], True, "no finite element: compared position by position (it raised)"),
    ([INF, INF], [NAN, INF], False, "no finite element, a mismatch"),
])
def test_non_finite_values_compare_position_by_position(got, ref, passes, why):
    max_rel, rms_rel = rel_errors(torch.tensor(got), torch.tensor(ref))
    assert (max_rel == 0.0 and rms_rel == 0.0) if passes else (max_rel == INF and rms_rel == INF), why


def test_empty_and_mismatched_shapes():
    assert rel_errors(torch.empty(0, 4), torch.empty(0, 4)) == (0.0, 0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_errors(torch.zeros(2), torch.zeros(3))
    check_close("bf16 budget", torch.ones(3), torch.ones(3), EXPERTS_TOL[torch.bfloat16])
