"""TWX's layout, without the encoder: what code that only reads headers and sizes (the planner, the
memory model) shares with the encoder, the decoders and the kernels. `kernels/FORMAT.md` is the same
layout for other engines."""
from __future__ import annotations

GROUP = 32  # weights per scale
# tensor-name suffixes of a TWX weight, in place of `weight`: `<module>.twx_codes`, `<module>.twx_scales`
CODES, SCALES = "twx_codes", "twx_scales"
SCALE_EXP_BIAS = 20  # UE5M3 scale = 2**(e - SCALE_EXP_BIAS) * (1 + m / 8)
# the config's quantize formats and the routed-expert bit budget each takes by default (all overhead counted)
FORMATS = {"twx3": {"bits_per_weight_max": 3.25}, "twx2.5": {"bits_per_weight_max": 2.75}}


def bits_per_weight(bits: int) -> float:
    """A TWX code's bits per weight, its block scale included: 3.25 (TWX3), 2.25 (TWX2)."""
    return bits + 8 / GROUP
