"""TWX codes: the reference decoder agrees with a decoder written from kernels/FORMAT.md alone."""
import json
import re
from pathlib import Path

import pytest
import torch

from moeshrink.formats import mxfp4, twx, twx_vq

FORMAT_PAGE = Path(__file__).resolve().parent.parent / "kernels" / "FORMAT.md"


def levels_from_page() -> dict[int, list[float]]:
    text = FORMAT_PAGE.read_text()
    table = {}
    for bits in (3, 2):
        row = re.search(rf"^\| {bits} \| ([^|]+) \|$", text, re.M)
        table[bits] = [float(v) for v in row.group(1).split(",")]
    return table


def page_decode(codes: torch.Tensor, scales: torch.Tensor, value=None) -> torch.Tensor:
    """Straight from FORMAT.md: a bit string per row, UE5M3 scales, float32 arithmetic; `value(row_bits,
    j, bits)` is weight j's unscaled value (by default version 1's: the levels table)."""
    levels = {bits: torch.tensor(values, dtype=torch.float32) for bits, values in levels_from_page().items()}

    def level(row_bits: int, j: int, bits: int) -> float:
        return float(levels[bits][(row_bits >> (j * bits)) & ((1 << bits) - 1)])

    rows, nbytes = codes.shape
    k = 32 * scales.shape[1]
    bits = 8 * nbytes // k
    out = torch.empty(rows, k, dtype=torch.float32)
    for r in range(rows):
        row_bits = int.from_bytes(bytes(codes[r].tolist()), "little")
        for j in range(k):
            s = int(scales[r, j // 32])
            scale = 2.0 ** ((s >> 3) - 20) * (1 + (s & 7) / 8)
            out[r, j] = torch.tensor((value or level)(row_bits, j, bits), dtype=torch.float32) * torch.tensor(
                scale, dtype=torch.float32)
    return out


@pytest.mark.parametrize("bits", [3, 2])
def test_reference_decoder_matches_the_format_page(bits):
    torch.manual_seed(bits)
    weight = mxfp4.quantize_values(torch.randn(5, 96) * 0.05)
    codes, scales = twx.encode(weight, bits)
    assert codes.shape == (5, 96 * bits // 8) and scales.shape == (5, 3)
    assert torch.equal(twx.decode(codes, scales, torch.float32), page_decode(codes, scales))
    assert twx.LEVELS[bits].tolist() == pytest.approx(levels_from_page()[bits])


def test_quantization_config_levels_are_the_page_levels():
    from moeshrink.compress.builder import quantization_config

    cfg = quantization_config({"quantize": {"format": "twx3", "expert_bits": {}}, "source_format": "mxfp4"})
    page = levels_from_page()
    for bits, values in cfg["levels"].items():
        assert values == pytest.approx(page[int(bits)])
    assert cfg["format_version"] == 1 and cfg["group_size"] == 32
    json.dumps(cfg)


@pytest.mark.parametrize("bits", [3, 2])
def test_encoder_chooses_the_best_searched_scale_and_levels(bits):
    torch.manual_seed(0)
    weight = torch.randn(8, 64) * 0.1
    codes, scales = twx.encode(weight, bits)
    decoded = twx.decode(codes, scales, torch.float32)
    blocks, rec = weight.reshape(-1, 32), decoded.reshape(-1, 32)
    chosen = ((rec - blocks) ** 2).sum(1)
    for b in range(blocks.shape[0]):
        base = int(twx.nearest_scale_bytes(blocks[b].abs().max()))
        for step in twx.SEARCH_STEPS:
            scale = float(twx.decode_scales(torch.tensor([base + step], dtype=torch.uint8)))
            nearest = twx.LEVELS[bits][(blocks[b, :, None] / scale - twx.LEVELS[bits]).abs().argmin(1)] * scale
            assert chosen[b] <= ((nearest - blocks[b]) ** 2).sum() + 1e-12


def test_exact_zero_survives_three_bit_codes():
    weight = torch.zeros(2, 32)
    weight[0, 3] = 0.5
    codes, scales = twx.encode(weight, 3)
    decoded = twx.decode(codes, scales, torch.float32)
    assert decoded[1].abs().sum() == 0 and decoded[0, 0] == 0 and decoded[0, 3] == pytest.approx(0.5, rel=0.07)


@pytest.mark.parametrize("bits,limit", [(3, 0.03), (2, 0.12)])
def test_relative_error_on_mxfp4_published_gaussians(bits, limit):
    torch.manual_seed(1)
    weight = mxfp4.quantize_values(torch.randn(64, 256) * 0.02)
    codes, scales = twx.encode(weight, bits)
    error = (twx.decode(codes, scales, torch.float32) - weight).pow(2).sum() / weight.pow(2).sum()
    assert error < limit
    assert 8 * (codes.numel() + scales.numel()) / weight.numel() == twx.bits_per_weight(bits)


@pytest.mark.parametrize("codec", [twx, twx_vq], ids=["v1", "v2"])
def test_bad_shapes_and_widths_are_named(codec):
    with pytest.raises(twx.TWXFormatError, match=r"w: .*multiple of 32"):
        codec.encode(torch.zeros(4, 30), 3, name="w")
    with pytest.raises(twx.TWXFormatError, match="-bit codes, not 4"):
        codec.encode(torch.zeros(4, 32), 4, name="w")
    with pytest.raises(twx.TWXFormatError, match=r"w: codes \(4, 10\) hold 2.5 bits"):
        codec.decode(torch.zeros(4, 10, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), name="w")


def test_decoding_ignores_the_default_dtype_it_is_imported_under(tmp_path):
    """vLLM sets torch's default dtype to bfloat16 while it builds a model, which is when the plugin
    first imports the decoders: they must decode bit for bit as they do anywhere else."""
    import subprocess
    import sys

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    codes, scales = twx.encode(weight, 3)
    packed, mx_scales = mxfp4.encode(weight)
    torch.save({"codes": codes, "scales": scales, "packed": packed, "mx_scales": mx_scales}, tmp_path / "in.pt")
    script = ("import torch; torch.set_default_dtype(torch.bfloat16)\n"
              "from moeshrink.formats import mxfp4, twx\n"
              f"d = torch.load({str(tmp_path / 'in.pt')!r})\n"
              "torch.save({'twx': twx.decode(d['codes'], d['scales'], torch.bfloat16),"
              " 'mxfp4': mxfp4.decode(d['packed'], d['mx_scales'], torch.float32)}, "
              f"{str(tmp_path / 'out.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    out = torch.load(tmp_path / "out.pt")
    assert torch.equal(out["twx"], twx.decode(codes, scales, torch.bfloat16))
    assert torch.equal(out["mxfp4"], mxfp4.decode(packed, mx_scales, torch.float32))


@pytest.mark.parametrize("codec", [twx, twx_vq], ids=["v1", "v2"])
def test_a_non_finite_weight_is_named_not_encoded(codec):
    weight = torch.randn(300, 64)  # past the first chunk of rows
    weight[290, 37] = float("nan")
    weight[299, 0] = float("inf")
    with pytest.raises(twx.TWXFormatError,
                       match=r"layers.1.mlp.experts.5.down_proj: non-finite weights, the first at row 290, column 37"):
        codec.encode(weight, 3, name="layers.1.mlp.experts.5.down_proj")


@pytest.mark.parametrize("bits", [2, 3])
def test_the_fast_scale_search_chooses_exactly_what_the_plain_search_chooses(bits):
    generator = torch.Generator().manual_seed(bits)
    values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    mxfp4_exact = values[torch.randint(0, 16, (300, 512), generator=generator)] * torch.ldexp(
        torch.ones(300, 16), torch.randint(-12, -2, (300, 16), generator=generator)).repeat_interleave(32, 1)
    blocks_of = mxfp4_exact.reshape(-1, 32)
    mixed = torch.cat([blocks_of[:40], torch.zeros(4, 32), blocks_of[40:80] * 2.0 ** -36,  # values off the table
                       blocks_of[80:120] * 2.0 ** 30, blocks_of[120:160] * (torch.rand(40, 32) < 0.1),
                       torch.randn(40, 32, generator=generator)]).reshape(-1, 64)
    for weight in (mxfp4_exact.to(torch.bfloat16), torch.randn(2100, 96, generator=generator) * 0.02,
                   torch.zeros(3, 64), mixed):  # 2100 x 3 blocks: more than one chunk, the last one partial
        fast, plain = twx.encode(weight, bits), twx.encode_plain(weight, bits)
        assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])


@pytest.mark.parametrize("bits", [2, 3])
def test_the_table_search_decides_mxfp4_blocks_and_hands_the_rest_to_the_per_weight_search(bits, monkeypatch):
    generator = torch.Generator().manual_seed(10 + bits)
    mxfp4_blocks = mxfp4.quantize_values(torch.distributions.Laplace(0.0, 0.02).sample((4000, 32)))
    _, _, decided = twx._table_search(mxfp4_blocks, bits)
    assert decided.mean() > 0.99
    _, _, decided = twx._table_search(torch.randn(500, 32, generator=generator), bits)
    assert not decided.any()  # 23 mantissa bits: no table keys
    weight = mxfp4_blocks.reshape(-1, 256)
    plain = twx.encode_plain(weight, bits)
    monkeypatch.setattr(twx, "NEAR_TIE", 0.05)  # many more blocks go to the per-weight search: same result
    _, _, decided = twx._table_search(mxfp4_blocks, bits)
    assert 0.05 < decided.mean() < 0.95
    fast = twx.encode(weight, bits)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
