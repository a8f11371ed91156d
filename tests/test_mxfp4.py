"""The MXFP4 codec against an independent decoder written from the OCP Microscaling spec v1.0."""
import math

import pytest
import torch

from moeshrink.formats import mxfp4


def spec_e2m1(code: int) -> float:
    """OCP MX v1.0, section 5.3.3: FP4 E2M1, exponent bias 1, no inf/NaN, subnormal when E == 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:
        return sign * 2.0 ** (1 - 1) * (mantissa / 2)
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def spec_e8m0(byte: int) -> float:
    """E8M0: an unsigned exponent with bias 127; 0xFF is NaN."""
    return math.nan if byte == 0xFF else 2.0 ** (byte - 127)


def spec_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for r in range(rows):
        for i in range(half):
            byte = int(packed[r, i])
            for j, code in enumerate((byte & 0xF, byte >> 4)):  # low nibble holds the earlier element
                k = 2 * i + j
                out[r, k] = spec_e2m1(code) * spec_e8m0(int(scales[r, k // 32]))
    return out


def test_all_sixteen_codes_decode_as_the_spec_says():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2)[None]  # 32 values: the 16 codes twice
    scales = torch.tensor([[127]], dtype=torch.uint8)
    ours = mxfp4.decode(packed, scales, torch.float32)
    expected = [spec_e2m1(c) for c in range(16)] * 2
    assert ours.flatten().tolist() == expected
    assert sorted({abs(v) for v in expected}) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.mark.parametrize("scale_std", [1e-3, 0.02, 1.0, 300.0])
def test_round_trip_matches_the_independent_decoder(scale_std):
    torch.manual_seed(0)
    x = torch.randn(6, 96) * scale_std
    x[0, :32] = 0.0  # an all-zero block
    packed, scales = mxfp4.encode(x)
    assert packed.shape == (6, 48) and scales.shape == (6, 3)
    assert packed.dtype == scales.dtype == torch.uint8
    ours = mxfp4.decode(packed, scales, torch.float32).double()
    assert torch.equal(ours, spec_decode(packed, scales))
    # re-encoding decoded values is lossless, and bf16 holds them exactly
    assert all(torch.equal(a, b) for a, b in zip(mxfp4.encode(ours.float()), (packed, scales)))
    assert torch.equal(mxfp4.decode(packed, scales, torch.bfloat16).double(), ours)
    assert torch.equal(mxfp4.quantize_values(x).double(), ours)


def test_encoder_picks_the_nearest_value_for_the_spec_scale():
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    packed, scales = mxfp4.encode(x)
    decoded = spec_decode(packed, scales)
    grid = torch.tensor(sorted({spec_e2m1(c) for c in range(16)}), dtype=torch.float64)
    for r in range(4):
        for b in range(2):
            block = x[r, 32 * b:32 * b + 32].double()
            # spec: X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 2 for E2M1
            shared = math.floor(math.log2(block.abs().max().item())) - 2
            assert spec_e8m0(int(scales[r, b])) == 2.0 ** shared
            scaled = (block / 2.0 ** shared).clamp(-6, 6)
            nearest_distance = (scaled[:, None] - grid[None, :]).abs().min(dim=1).values
            chosen_distance = (decoded[r, 32 * b:32 * b + 32] / 2.0 ** shared - scaled).abs()
            assert torch.allclose(chosen_distance, nearest_distance)


def test_ties_round_to_even_and_large_values_saturate():
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.75, -5.0] + [0.0] * 21 + [4.0])
    assert mxfp4.quantize_values(row[None])[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]


def test_scale_extremes():
    tiny = torch.full((1, 32), 2.0 ** -126)
    huge = torch.full((1, 32), 2.0 ** 126)
    for x, byte in ((tiny, 0), (huge, 251)):
        packed, scales = mxfp4.encode(x)
        assert int(scales[0, 0]) == byte
        assert torch.equal(mxfp4.decode(packed, scales, torch.float32), x)
    extremes = torch.tensor([[0], [254]], dtype=torch.uint8)
    ones = torch.full((2, 16), 0x22, dtype=torch.uint8)  # code 2 = 1.0 in both nibbles
    decoded = mxfp4.decode(ones, extremes, torch.float32)
    assert decoded[0, 0].item() == 2.0 ** -127 and decoded[1, 0].item() == 2.0 ** 127


@pytest.mark.parametrize("shape", [(3, 33), (31,), (2, 16), ()])
def test_shapes_that_do_not_fill_blocks_are_rejected_by_name(shape):
    with pytest.raises(mxfp4.MXFP4ShapeError, match=r"w1.*multiple of 32"):
        mxfp4.encode(torch.zeros(shape), name="w1")


def test_mismatched_or_nan_scales_are_rejected():
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(mxfp4.MXFP4ShapeError, match="do not match"):
        mxfp4.decode(packed, torch.zeros(2, 1, dtype=torch.uint8), name="x")
    with pytest.raises(mxfp4.MXFP4ShapeError, match="NaN"):
        mxfp4.decode(packed, torch.full((2, 2), 255, dtype=torch.uint8), name="x")
    with pytest.raises(mxfp4.MXFP4ShapeError, match="uint8"):
        mxfp4.decode(packed.float(), torch.zeros(2, 2, dtype=torch.uint8), name="x")


def test_fake_quantize_passes_gradients_straight_through():
    x = torch.randn(2, 64, requires_grad=True)
    y = mxfp4.fake_quantize(x)
    assert torch.equal(y.detach(), mxfp4.quantize_values(x))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
