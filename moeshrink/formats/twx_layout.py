"""TWX's layout, without the encoder: what code that only reads headers and sizes (the planner, the
memory model) shares with the encoder, the decoders and the kernels, and the two TWX formats' entries
in the format registry (version 1 and version 2 of each). `kernels/FORMAT.md` is the same layout for other engines."""
from __future__ import annotations

from pathlib import Path

from moeshrink.core.expert_formats import ExpertFormat, register

GROUP = 32  # weights per scale
# tensor-name suffixes of a TWX weight, in place of `weight`: `<module>.twx_codes`, `<module>.twx_scales`;
# version 2's codes mean something else in tensors of the same shapes, so its tensors have names of their own
CODES, SCALES = "twx_codes", "twx_scales"
VQ_CODES, VQ_SCALES = "tw2_codes", "tw2_scales"
SCALE_EXP_BIAS = 20  # UE5M3 scale = 2**(e - SCALE_EXP_BIAS) * (1 + m / 8)
VQ_CODEBOOKS = Path(__file__).with_name("twx_vq_codebooks.safetensors")  # version 2's format constants


def bits_per_weight(bits: int) -> float:
    """A TWX code's bits per weight, its block scale included: 3.25 (TWX3), 2.25 (TWX2)."""
    return bits + 8 / GROUP


# TWX3: every expert in 3-bit codes; TWX2.5: 3-bit codes for the most sensitive experts, 2-bit for the
# rest, within the budget (by default 2.75 bits per weight, all overhead counted)
TWX3 = register(ExpertFormat("twx3", "twx", (3,), bits_per_weight(3), GROUP, 8, CODES, SCALES, "moeshrink.formats.twx"))
TWX2_5 = register(ExpertFormat("twx2.5", "twx", (2, 3), 2.75, GROUP, 8, CODES, SCALES, "moeshrink.formats.twx"))
# format version 2 of both: an index per 4 weights into a codebook of 4-vectors (moeshrink.formats.twx_vq)
TWX3_V2 = register(ExpertFormat("twx3-v2", "twx", (3,), bits_per_weight(3), GROUP, 8, VQ_CODES, VQ_SCALES,
                                "moeshrink.formats.twx_vq", "twx_vq", VQ_CODEBOOKS, weighted_encoder=True))
TWX2_5_V2 = register(ExpertFormat("twx2.5-v2", "twx", (2, 3), 2.75, GROUP, 8, VQ_CODES, VQ_SCALES,
                                  "moeshrink.formats.twx_vq", "twx_vq", VQ_CODEBOOKS, weighted_encoder=True))
