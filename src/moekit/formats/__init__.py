"""Low-precision weight formats, bit-exact to ../shared/reference/formats.md (see each module):
:mod:`fp4` (E2M1 codes and nibble packing), :mod:`nvfp4`, :mod:`mxfp4`, :mod:`fp8`.

These are host-side format routines (quantize at load time, dequantize for references and
fallbacks); they run on any device with plain torch.
"""

from . import fp4, fp8, mxfp4, nvfp4

__all__ = ["fp4", "fp8", "mxfp4", "nvfp4"]
