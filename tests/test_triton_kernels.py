"""The Triton packed-expert kernels against reference decode + matmul.

With a CUDA GPU they run here on it. Without one they run in Triton's interpreter, which has to be
switched on (TRITON_INTERPRET=1) before triton is first imported: triton decorates its own
library functions (tl.sum, tl.cdiv) at import. A full test session imports triton while collecting
other modules, so `test_kernels_under_the_interpreter` reruns this file in a child process started
with the variable set, and the kernel tests of the parent process skip. Shapes are kept small."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from moeshrink.formats import mxfp4
from moeshrink_kernels.experts import TWX_CODECS, TWXLayout, mxfp4_routed_experts, twx_routed_experts  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
CHILD = "MOESHRINK_TRITON_TEST_CHILD"
ON_GPU = torch.cuda.is_available() and not INTERPRETING
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
FORMATS = ["twx3", "twx2", "twx3v2", "twx2v2", "mxfp4"]  # TWX code widths, format versions 1 and 2
# (N, K): the organism's w13 and w2 (hidden 128, moe intermediate 64), and a small DeepSeek-V3-like one
SHAPES = [(128, 128), (128, 64), (192, 256)]


@pytest.fixture(scope="module")
def te():
    if not (ON_GPU or INTERPRETING):
        pytest.skip("no CUDA GPU: runs in the TRITON_INTERPRET=1 child of test_kernels_under_the_interpreter")
    from moeshrink_kernels import _triton_packed, triton_experts

    assert triton_experts.triton_available()
    assert _triton_packed.INTERPRETED == INTERPRETING
    return triton_experts


@pytest.mark.skipif(ON_GPU or INTERPRETING, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                         cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]
    assert " passed" in out.stdout, out.stdout[-2000:]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float().cpu() - expected).norm() / expected.norm())


def twx_bits_version(fmt: str) -> tuple[int, int]:
    """"twx3" -> (3, 1), "twx2v2" -> (2, 2)."""
    return int(fmt[3]), 2 if fmt.endswith("v2") else 1


def packed(fmt: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, reference float32 decode)."""
    if fmt == "mxfp4":
        codes, scales = mxfp4.encode(weight)
        return codes, scales, mxfp4.decode(codes, scales, torch.float32)
    bits, version = twx_bits_version(fmt)
    codes, scales = TWX_CODECS[version].encode(weight, bits)
    return codes, scales, TWX_CODECS[version].decode(codes, scales, torch.float32)


def linear(te, fmt: str, x, codes, scales, **options):
    x, codes, scales = x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE)
    if fmt == "mxfp4":
        return te.mxfp4_linear(x, codes, scales, **options)
    bits, version = twx_bits_version(fmt)
    return te.twx_linear(x, codes, scales, bits, version=version, **options)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_matches_reference_decode_and_matmul(te, fmt, shape):
    generator = torch.Generator().manual_seed(shape[0] + shape[1])
    codes, scales, weight = packed(fmt, torch.randn(*shape, generator=generator) * 0.05)
    for m in (1, 4, 16, 33):
        x = torch.randn(m, shape[1], generator=generator).to(torch.bfloat16)
        got = linear(te, fmt, x, codes, scales)
        assert got.dtype == torch.bfloat16 and got.shape == (m, shape[0])
        assert relative_error(got, x.float() @ weight.T) <= 1e-2, (fmt, shape, m)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_config_variant_agrees(te, fmt):
    """Table and arithmetic level decode, tl.dot and the broadcast-sum path, split K, odd blocks."""
    generator = torch.Generator().manual_seed(7)
    codes, scales, weight = packed(fmt, torch.randn(96, 256, generator=generator) * 0.05)
    x = torch.randn(5, 256, generator=generator).to(torch.bfloat16)
    expected = x.float() @ weight.T
    configs = [te.KernelConfig(lut=True), te.KernelConfig(swap_ab=False),
               te.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=2, lut=True),
               te.KernelConfig(block_m=2, block_n=32, block_k=64, use_dot=False),
               te.KernelConfig(block_m=4, block_n=64, block_k=32, use_dot=False, split_k=4, lut=True)]
    for config in configs:
        got = linear(te, fmt, x, codes, scales, out_dtype=torch.float32, config=config)
        assert got.dtype == torch.float32
        assert relative_error(got, expected) <= 1e-2, config


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lut", [True, False])
def test_decode_is_exact_for_every_code_and_scale(te, fmt, lut):
    """x = identity in float32 reads the decoded weights back: random bytes cover every code, every
    UE5M3 scale byte and E8M0 bytes 0-200 (larger ones overflow float32 in the reference too)."""
    generator = torch.Generator().manual_seed(11)
    n, k = 40, 64  # blocks overhang N (and K for TWX3's 128-wide K blocks)
    bits, version = (4, 0) if fmt == "mxfp4" else twx_bits_version(fmt)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 201 if fmt == "mxfp4" else 256, (n, k // 32), generator=generator, dtype=torch.uint8)
    decode = mxfp4.decode if fmt == "mxfp4" else TWX_CODECS[version].decode
    weight = decode(codes, scales, torch.float32)
    config = te.KernelConfig(block_m=16, block_n=16, block_k=128 if bits == 3 else 64, lut=lut)
    got = linear(te, fmt, torch.eye(k), codes, scales, config=config).cpu()
    if ON_GPU:  # tf32 dot
        assert relative_error(got, weight.T) <= 1e-2
    else:
        assert torch.equal(got, weight.T)


def test_fp16_and_fp32_inputs(te):
    generator = torch.Generator().manual_seed(3)
    codes, scales, weight = packed("twx3", torch.randn(64, 128, generator=generator) * 0.05)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(3, 2, 128, generator=generator).to(dtype)
        got = linear(te, "twx3", x, codes, scales)
        assert got.dtype == dtype and got.shape == (3, 2, 64)
        assert relative_error(got, x.float() @ weight.T) <= 1e-2


def test_rejects_codes_past_the_buffer(te):
    codes, scales, _ = packed("twx2", torch.randn(64, 128) * 0.05)
    offsets = torch.tensor([0, 64 * 32 + 1])  # expert 1 would read one byte past the end
    x = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEVICE)
    grouped = te.grouped_packed_matmul
    both = torch.cat([codes.reshape(-1), codes.reshape(-1)]).to(DEVICE)
    two_scales = torch.stack([scales, scales]).to(DEVICE)
    with pytest.raises(ValueError, match="expert 1: codes at byte 2049 run past the 4096-byte buffer"):
        grouped(x, [1, 1], both, two_scales, offsets, [2, 2])
    assert grouped(x, [1, 1], both, two_scales, torch.tensor([0, 64 * 32]), [2, 2]).shape == (2, 64)


def routing(tokens: int, experts: int, top_k: int, generator: torch.Generator):
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    ids[0, -1] = -1  # a slot routed nowhere (expert parallelism masks foreign experts like this)
    return weights, ids


@pytest.mark.parametrize("version", [1, 2])
def test_twx25_routed_experts_match_cpu_path(te, version):
    hidden, inter, bits = 128, 64, [3, 2, 3, 3, 2, 2, 3, 2]
    generator = torch.Generator().manual_seed(5)
    layout = TWXLayout.of(bits, hidden, inter)
    codec = TWX_CODECS[version]
    codes13, scales13, codes2, scales2 = [], [], [], []
    for b in bits:
        c, s = codec.encode(torch.randn(2 * inter, hidden, generator=generator) * 0.05, b)
        codes13.append(c.reshape(-1)), scales13.append(s)
        c, s = codec.encode(torch.randn(hidden, inter, generator=generator) * 0.05, b)
        codes2.append(c.reshape(-1)), scales2.append(s)
    tensors = (torch.cat(codes13), torch.stack(scales13), torch.cat(codes2), torch.stack(scales2), layout.as_tensor())
    x = torch.randn(9, hidden, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(9, len(bits), 3, generator)
    expected = twx_routed_experts(x, topk_weights, topk_ids, *tensors, version=version)
    got = te.triton_twx_routed_experts(*(t.to(DEVICE) for t in (x, topk_weights, topk_ids, *tensors[:4])), tensors[4],
                                       version)
    assert got.dtype == x.dtype and got.shape == x.shape
    # Triton 3.9's interpreter truncates float32 -> bf16 casts (runtime/interpreter.py cast_impl: no
    # rounding mode) where a GPU rounds to nearest; v2's codewords are rarely bf16-exact, which doubles
    # the gap there (measured: v1 0.0057, v2 0.0109; against a float64 reference the CPU path is 0.0017
    # for both, so the decode itself is exact: test_decode_is_exact_for_every_code_and_scale)
    assert relative_error(got, expected.float()) <= (2e-2 if INTERPRETING and version == 2 else 1e-2)


def test_mxfp4_routed_experts_match_cpu_path(te):
    hidden, inter, experts = 128, 64, 6
    generator = torch.Generator().manual_seed(6)
    pairs13 = [mxfp4.encode(torch.randn(2 * inter, hidden, generator=generator) * 0.05) for _ in range(experts)]
    pairs2 = [mxfp4.encode(torch.randn(hidden, inter, generator=generator) * 0.05) for _ in range(experts)]
    tensors = [torch.stack([p[i] for p in pairs]) for pairs in (pairs13, pairs2) for i in (0, 1)]
    x = torch.randn(7, hidden, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(7, experts, 2, generator)
    expected = mxfp4_routed_experts(x, topk_weights, topk_ids, *tensors)
    got = te.triton_mxfp4_routed_experts(*(t.to(DEVICE) for t in (x, topk_weights, topk_ids, *tensors)))
    assert relative_error(got, expected.float()) <= 1e-2


@pytest.mark.skipif(CHILD in os.environ, reason="the parent process runs it")
def test_module_imports_without_triton():
    code = ("import sys, torch\n"
            "sys.modules['triton'] = None  # import triton fails\n"
            "import moeshrink_kernels.triton_experts as te\n"
            "assert not te.triton_available()\n"
            "codes, scales = torch.zeros(2, 12, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)\n"
            "try:\n"
            "    te.twx_linear(torch.zeros(1, 32), codes, scales, 3)\n"
            "except te.TritonUnavailable:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('ran without triton')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
