"""moekit: accurate, fast Mixture-of-Experts inference layers (PyTorch + Triton)."""

from . import presets, reference
from .presets import MoESpec
from .routing import route

__version__ = "0.1.0"

__all__ = ["MoESpec", "presets", "reference", "route"]
