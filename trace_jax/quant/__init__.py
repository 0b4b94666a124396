"""FP4/FP8 block-scaled quantization shared bit for bit by rollout, trainer and kernels.

Public API (names others rely on, see DESIGN.md): `quantize`, `dequantize`, `QArray`,
`fake_quant`, `make_guidance`, `Guidance`, `guided_fake_quant`, `QuantPolicy`, `make_policy`.
"""

from trace_jax.quant.e2m1 import E2M1_GRID, E2M1_VALUES
from trace_jax.quant.fake_quant import fake_quant, quantize_grad, stochastic_fake_quant
from trace_jax.quant.formats import FORMATS, Format, get_format
from trace_jax.quant.guided_round import (Guidance, concatenate, guidance_bits_per_element,
                                          guided_fake_quant,
                                          guided_quantize, make_guidance, map_blocked,
                                          reshape_rows,
                                          take_rows)
from trace_jax.quant.policy import PRESETS, QuantPolicy, make_policy
from trace_jax.quant.qarray import (QArray, dequantize, quantize, quantize_with_value,
                                    with_packing)

__all__ = [
    "E2M1_GRID", "E2M1_VALUES", "FORMATS", "concatenate", "Format", "Guidance", "PRESETS", "QArray",
    "QuantPolicy", "dequantize", "fake_quant", "get_format", "guidance_bits_per_element",
    "guided_fake_quant", "guided_quantize", "make_guidance", "make_policy", "map_blocked", "quantize",
    "quantize_grad", "quantize_with_value", "reshape_rows", "stochastic_fake_quant", "take_rows",
    "with_packing",
]
