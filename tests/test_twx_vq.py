"""TWX format version 2: the reference decoder agrees with a decoder written from kernels/FORMAT.md
alone, the encoder keeps the best of the scales it searches, and v2 loses less than v1."""
import re
from pathlib import Path

import pytest
import test_twx
import torch

from moeshrink.core import expert_formats
from moeshrink.core.ioutil import sha256_file
from moeshrink.formats import mxfp4, twx, twx_vq

FORMAT_PAGE = Path(__file__).resolve().parent.parent / "kernels" / "FORMAT.md"


def page_decode(codes: torch.Tensor, scales: torch.Tensor, books: dict[int, torch.Tensor]) -> torch.Tensor:
    """Straight from FORMAT.md's version 2: index g of 4 * bits bits at bit 4 * bits * g of the row,
    weight 4g + d its codeword's entry d."""
    def entry(row_bits: int, j: int, bits: int) -> float:
        return float(books[bits][(row_bits >> (4 * bits * (j // 4))) & ((1 << (4 * bits)) - 1), j % 4])

    return test_twx.page_decode(codes, scales, entry)


def test_the_page_names_the_codebook_file_by_its_sha256():
    text = FORMAT_PAGE.read_text()
    match = re.search(r"`twx_vq_codebooks\.safetensors`, sha256 `([0-9a-f]{64})`", text)
    assert match, "FORMAT.md must name the codebook file and its sha256"
    assert match[1] == sha256_file(twx_vq.CODEBOOK_FILE) == twx_vq.codebook_sha256()
    books = twx_vq.codebooks()
    assert {b: tuple(t.shape) for b, t in books.items()} == {2: (256, 4), 3: (4096, 4)}
    assert all(t.dtype == torch.float32 for t in books.values())


@pytest.mark.parametrize("bits", [3, 2])
def test_the_code_is_odd_so_its_errors_carry_no_sign_bias(bits):
    """Entry k + N/2 is entry k negated and entry 0 is zero: a weight matrix and its negation decode to
    negations of each other, and all-zero 4-vectors stay zero (a code whose zero vector went to one fixed
    codeword would add the same error pattern to every row)."""
    book = twx_vq.codebooks()[bits]
    assert torch.equal(book[book.shape[0] // 2:], -book[:book.shape[0] // 2]) and not book[0].any()
    weight = mxfp4.quantize_values(torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)) * 0.02)
    weight[:, 32:40] = 0
    decoded = twx_vq.decode(*twx_vq.encode(weight, bits), torch.float32)
    assert torch.equal(twx_vq.decode(*twx_vq.encode(-weight, bits), torch.float32), -decoded)
    assert not decoded[:, 32:40].any()


def test_a_codebook_that_is_not_odd_is_refused_by_name(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    books = {f"codebook.{b}": t.clone() for b, t in twx_vq.codebooks().items()}
    books["codebook.3"][4096 // 2 + 7] += 0.5
    save_file(books, str(tmp_path / "books.safetensors"))
    monkeypatch.setattr(twx_vq, "CODEBOOK_FILE", tmp_path / "books.safetensors")
    twx_vq.codebooks.cache_clear()
    try:
        refused = r"books\.safetensors: codebook\.3: entry k \+ 2048 must be entry k negated"
        with pytest.raises(twx.TWXFormatError, match=refused):
            twx_vq.codebooks()
    finally:
        twx_vq.codebooks.cache_clear()


@pytest.mark.parametrize("bits", [3, 2])
def test_reference_decoder_matches_the_format_page(bits):
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 256, (3, 64 * bits // 8), generator=generator, dtype=torch.uint8)
    scales = torch.randint(60, 200, (3, 2), generator=generator, dtype=torch.uint8)
    books = {b: t.clone() for b, t in twx_vq.codebooks().items()}
    assert torch.equal(twx_vq.decode(codes, scales, torch.float32), page_decode(codes, scales, books))
    weight = mxfp4.quantize_values(torch.randn(5, 96, generator=generator) * 0.05)
    codes, scales = twx_vq.encode(weight, bits)
    assert codes.shape == (5, 96 * bits // 8) and scales.shape == (5, 3)
    assert torch.equal(twx_vq.decode(codes, scales, torch.float32), page_decode(codes, scales, books))


@pytest.mark.parametrize("bits", [3, 2])
def test_encoder_keeps_the_best_searched_scale_with_nearest_codewords(bits):
    """Against a brute-force search written apart: every scale step, every codeword, per block."""
    generator = torch.Generator().manual_seed(10 + bits)
    weight = mxfp4.quantize_values(torch.randn(4, 64, generator=generator) * 0.03)
    codes, scales = twx_vq.encode(weight, bits)
    decoded = twx_vq.decode(codes, scales, torch.float32)
    book = twx_vq.codebooks()[bits].double()
    blocks = weight.double().reshape(-1, 32)
    got = (decoded.double().reshape(-1, 32) - blocks).square().sum(dim=1)
    base = twx.nearest_scale_bytes(weight.reshape(-1, 32).abs().amax(dim=1) / twx_vq.codebooks()[bits].abs().max())
    for block in range(blocks.shape[0]):
        best = float("inf")
        for step in twx_vq.SEARCH_STEPS:
            scale = float(twx.decode_scales((base[block] + step).clamp(0, 255)))
            vectors = blocks[block].reshape(-1, 4) / scale
            nearest = torch.cdist(vectors, book).argmin(dim=1)
            best = min(best, float((book[nearest] * scale - blocks[block].reshape(-1, 4)).square().sum()))
        assert float(got[block]) <= best * (1 + 1e-5) + 1e-30, block


@pytest.mark.parametrize("bits", [3, 2])
def test_a_weighted_encoder_keeps_the_best_scale_and_codewords_in_the_weighted_error(bits, monkeypatch):
    """With input-column importance, against a brute-force search written apart, per block, by the
    weighted squared error (`error_weights`): every scale step, and per 4-vector the 64 codewords nearest
    in the book to its plain nearest (the format page's rule); and within 1% of trying every codeword.
    It loses less than the plain encoder by that error."""
    generator = torch.Generator().manual_seed(20 + bits)
    weight = mxfp4.quantize_values(torch.randn(4, 64, generator=generator) * 0.03)
    importance = torch.rand(64, generator=generator) ** 4
    cost = twx_vq.error_weights(importance, 64, "w").double()
    monkeypatch.setattr(twx_vq, "_DENSE", {})
    monkeypatch.setattr(twx_vq, "_PAIRS", {})
    decoded = twx_vq.decode(*twx_vq.encode(weight, bits, importance=importance), torch.float32)
    book = twx_vq.codebooks()[bits].double()
    blocks, block_cost = weight.double().reshape(-1, 32), cost.expand(4, -1).reshape(-1, 32)
    got = ((decoded.double().reshape(-1, 32) - blocks).square() * block_cost).sum(dim=1)
    base = twx.nearest_scale_bytes(weight.reshape(-1, 32).abs().amax(dim=1) / twx_vq.codebooks()[bits].abs().max())
    for block in range(blocks.shape[0]):
        by_rule = every = float("inf")
        vector_cost = block_cost[block].reshape(-1, 1, 4)
        for step in twx_vq.SEARCH_STEPS:
            scale = float(twx.decode_scales((base[block] + step).clamp(0, 255)))
            vectors = blocks[block].reshape(-1, 1, 4)
            errors = ((book[None] * scale - vectors).square() * vector_cost).sum(dim=-1)  # [8, entries]
            nearest = torch.cdist(vectors[:, 0] / scale, book).argmin(dim=1)
            tried = torch.cdist(book[nearest], book).topk(64, dim=1, largest=False).indices
            by_rule = min(by_rule, float(errors.gather(1, tried).min(dim=1).values.sum()))
            every = min(every, float(errors.min(dim=1).values.sum()))
        assert float(got[block]) <= by_rule * (1 + 1e-5) + 1e-30, block
        assert float(got[block]) <= every * 1.01 + 1e-30, block
    plain = twx_vq.decode(*twx_vq.encode(weight, bits), torch.float32).double()
    assert float(got.sum()) < float(((plain - weight.double()).square() * cost).sum())


@pytest.mark.parametrize("bits", [3, 2])
def test_a_weighted_code_stays_odd_and_no_importance_is_the_plain_code(bits):
    weight = mxfp4.quantize_values(torch.randn(8, 128, generator=torch.Generator().manual_seed(bits)) * 0.02)
    weight[:, 64:72] = 0
    importance = torch.rand(128, generator=torch.Generator().manual_seed(5))
    decoded = twx_vq.decode(*twx_vq.encode(weight, bits, importance=importance), torch.float32)
    assert torch.equal(twx_vq.decode(*twx_vq.encode(-weight, bits, importance=importance), torch.float32), -decoded)
    assert not decoded[:, 64:72].any()
    unreached = twx_vq.encode(weight, bits, importance=torch.zeros(128))
    assert all(torch.equal(a, b) for a, b in zip(unreached, twx_vq.encode(weight, bits)))


@pytest.mark.parametrize("importance,problem", [
    (torch.ones(64), r"experts\.3\.down_proj: importance must hold one value per input column \(128\), got \(64,\)"),
    (torch.ones(128).index_fill(0, torch.tensor([7]), float("nan")),
     r"experts\.3\.down_proj: importance of input column 7 is nan"),
    (torch.ones(128).index_fill(0, torch.tensor([9]), -1.0),
     r"importance of input column 9 is -1\.0; it must be finite and >= 0"),
])
def test_bad_importance_is_refused_by_name(importance, problem):
    with pytest.raises(twx.TWXFormatError, match=problem):
        twx_vq.encode(torch.zeros(4, 128), 2, name="experts.3.down_proj", importance=importance)


@pytest.mark.parametrize("bits,limit", [(3, 0.02), (2, 0.092)])
def test_v2_loses_less_than_v1_on_mxfp4_published_gaussians(bits, limit):
    weight = mxfp4.quantize_values(torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.02)

    def error(codec) -> float:
        codes, scales = codec.encode(weight, bits)
        assert 8 * (codes.numel() + scales.numel()) / weight.numel() == twx.bits_per_weight(bits)
        return float((codec.decode(codes, scales, torch.float32) - weight).pow(2).sum() / weight.pow(2).sum())

    assert error(twx_vq) < limit
    assert error(twx_vq) < 0.95 * error(twx)


def test_a_run_s_tables_are_made_for_the_format_s_constants():
    """The rule encoder_table takes the sha256 of the constants as a parameter: new codebooks, new tables."""
    for bits in (2, 3):
        owner = expert_formats.table_owner("twx_vq", bits)
        assert owner.codec_module() is twx_vq and owner.constants_sha256() == twx_vq.codebook_sha256()
    with pytest.raises(expert_formats.FormatError, match=r"no expert format keeps an encoder table 'twx_vq' at 4 bits"):
        expert_formats.table_owner("twx_vq", 4)
    assert expert_formats.get("twx3", "test").constants_sha256() is None


def test_v2_tensors_are_never_read_as_v1():
    """Same shapes, other meaning: version 2's tensors have names of their own, so a reader that
    finds them by name finds the right decoder."""
    names = {"m.experts.0.down_proj.tw2_codes", "m.experts.0.down_proj.tw2_scales",
             "m.experts.1.down_proj.twx_codes", "m.experts.1.down_proj.twx_scales"}
    v2 = expert_formats.encoded_weight("m.experts.0.down_proj.tw2_codes", names)
    v1 = expert_formats.encoded_weight("m.experts.1.down_proj.twx_codes", names)
    assert v2[0].codec_module() is twx_vq and v2[1:] == ("m.experts.0.down_proj.weight", "m.experts.0.down_proj.tw2_scales")
    assert v1[0].codec_module() is twx


def test_quantization_config_names_version_codebook_and_tensors():
    from moeshrink.compress.builder import quantization_config

    cfg = quantization_config({"quantize": {"format": "twx2.5-v2", "expert_bits": {}}, "source_format": "mxfp4"})
    assert cfg["format_version"] == 2 and cfg["quant_method"] == "twx" and cfg["format"] == "twx2.5-v2"
    assert cfg["codebook"] == {"dim": 4, "entries": {"2": 256, "3": 4096}, "file": "twx_vq_codebooks.safetensors",
                               "sha256": twx_vq.codebook_sha256()}
    assert cfg["tensors"] == {"codes": "tw2_codes", "scales": "tw2_scales"}


def plain_search_encode(weight: torch.Tensor, bits: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder with its table search deciding no block: every block through the plain search."""
    monkeypatch.setattr(twx_vq, "_table_search", lambda blocks, amax, bits: (
        torch.zeros(blocks.shape[0], dtype=torch.int64), torch.zeros(blocks.shape[0], 8, dtype=torch.int64),
        torch.zeros(blocks.shape[0], dtype=torch.bool)))
    return twx_vq.encode(weight, bits)


@pytest.mark.parametrize("bits", [2, 3])
def test_the_table_search_chooses_what_the_plain_search_chooses(bits, monkeypatch):
    """MXFP4 blocks go through the per-process table of (4-vector, scale row) pairs, anything else
    (here one row of plain floats and one of zeros) through the plain search: same bytes as the
    plain search everywhere."""
    generator = torch.Generator().manual_seed(20 + bits)
    weight = mxfp4.quantize_values(torch.randn(48, 256, generator=generator) * 0.02)
    weight[5] = torch.randn(256, generator=generator) * 0.02
    weight[6] = 0.0
    blocks = weight.reshape(-1, 32)
    _, _, decided = twx_vq._table_search(blocks, blocks.abs().amax(dim=1), bits)
    assert decided.reshape(48, -1).all(dim=1).sum() == 46 and not decided.reshape(48, -1)[5:7].any()
    fast = twx_vq.encode(weight, bits)
    plain = plain_search_encode(weight, bits, monkeypatch)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])


def test_an_encoder_table_on_disk_makes_the_plain_search_s_choices_and_covers_every_mxfp4_block(tmp_path, monkeypatch):
    """The table a run writes once: loaded in a fresh process, it answers every MXFP4 block at any
    power-of-two scale without a search, with the plain search's bytes. 2 bits: the 3-bit table
    takes about 11 s to write."""
    bits, table = 2, tmp_path / "twx_vq-2bit.safetensors"
    monkeypatch.setattr(twx_vq, "_PAIRS", {})
    monkeypatch.setattr(twx_vq, "_DENSE", {})
    written = twx_vq.write_encoder_table(bits, table)
    assert written["bits"] == "2" and written["codebook_sha256"] == twx_vq.codebook_sha256() and "isa" in written
    monkeypatch.setattr(twx_vq, "_PAIRS", {})
    monkeypatch.setattr(twx_vq, "_DENSE", {})
    assert twx_vq.load_encoder_table(table) == bits
    pairs = twx_vq._PAIRS[bits].keys.size
    assert pairs == written["pairs"]
    generator = torch.Generator().manual_seed(30)
    weight = mxfp4.quantize_values(torch.randn(64, 256, generator=generator)
                                   * torch.logspace(-6, 1, 64, base=2)[:, None])
    weight[3, :32] = torch.tensor([6.0, -0.0, 0.5, -4.0] * 8) * 2.0 ** -9  # -0.0 and a block at full range
    loaded = twx_vq.encode(weight, bits)
    assert twx_vq._PAIRS[bits].keys.size == pairs and bits in twx_vq._DENSE, "an MXFP4 block made a pair the table lacks"
    plain = plain_search_encode(weight, bits, monkeypatch)
    assert torch.equal(loaded[0], plain[0]) and torch.equal(loaded[1], plain[1])


def test_an_encoder_table_for_other_codebooks_or_damaged_is_refused_by_name(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    table = tmp_path / "twx_vq-2bit.safetensors"
    monkeypatch.setattr(twx_vq, "_PAIRS", {})
    monkeypatch.setattr(twx_vq, "_DENSE", {})
    twx_vq.write_encoder_table(2, table)
    with safe_open(str(table), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(table))
    foreign = tmp_path / "foreign.safetensors"
    save_file(tensors, str(foreign), {**metadata, "codebook_sha256": "0" * 64})
    with pytest.raises(twx.TWXFormatError, match=r"foreign\.safetensors: not a TWX v2 encoder table .*codebook_sha256"):
        twx_vq.load_encoder_table(foreign)
    damaged = tmp_path / "damaged.safetensors"
    save_file({**tensors, "keys": tensors["keys"].flip(0)}, str(damaged), metadata)
    with pytest.raises(twx.TWXFormatError, match=r"damaged\.safetensors: .*sorted distinct keys"):
        twx_vq.load_encoder_table(damaged)
