"""The accuracy gate: error metrics against the float64 references, and `moekit verify`."""

from .metrics import Tolerance, rel_errors, routes_agree, separable_tokens

__all__ = ["Tolerance", "rel_errors", "routes_agree", "separable_tokens"]
