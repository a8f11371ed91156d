"""Static cost of the Triton packed-expert kernel, no GPU needed: compiles it for an NVIDIA target
(default sm_90, H100/H200) with triton's bundled ptxas, disassembles the cubin with its nvdisasm,
and counts the instructions of the main K loop per weight decoded (per thread), with registers and
spills. A proxy for decode cost, not a speed measurement: bench/gpu.sh measures.

    python bench/triton_sass.py [--arch 90] [--json bench/results/triton_sass.json]

Reading the figure: an SM issues 4 warp instructions per cycle (128 thread instructions), most of
the integer and select instructions here at half that rate; streaming a packed format at a fraction
f of HBM bandwidth B needs about f * B / bytes_per_weight weights per second from all SMs.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moeshrink_kernels import _triton_packed as kernels  # noqa: E402
from moeshrink_kernels import triton_experts as te  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
FORMATS = {"twx3": 3, "twx2": 2, "mxfp4": te.MXFP4}
POINTERS = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "levels_ptr": "*fp32", "y_ptr": "*bf16",
            "block_expert_ptr": "*i32", "block_start_ptr": "*i32", "block_end_ptr": "*i32",
            "code_offset_ptr": "*i64", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32"}


def compile_cubin(fmt: int, config: te.KernelConfig, arch: int, n: int = 4096, k: int = 7168) -> bytes:
    constants = kernels.constexprs(fmt, config, n, k, torch.bfloat16)
    signature = dict(POINTERS, y_ptr="*fp32" if config.split_k > 1 else "*bf16", **{c: "constexpr" for c in constants})
    # what the launcher tells the compiler about DeepSeek-V3 shapes: 16-aligned pointers and sizes
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(POINTERS))}
    source = ASTSource(kernels.packed_matmul_kernel, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["cubin"]


def main_loop(sass: str) -> list[str]:
    """Instructions between a label and the farthest backward branch to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    spans = [(i - labels[m.group(1)], labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i]
    _, start, end = max(spans)
    return [line for line in lines[start:end + 1] if re.search(r"/\*[0-9a-f]{4,}\*/", line)]


def opcode(line: str) -> str:
    m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
    return m.group(1) if m else "?"


def analyse(fmt_name: str, config: te.KernelConfig, arch: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compile_cubin(FORMATS[fmt_name], config, arch))
        usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    registers, stack = (re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK"))
    loop = main_loop(sass)
    weights = config.block_n * config.block_k / (32 * config.num_warps)  # per thread per K step
    return {"format": fmt_name, "config": asdict(config), "registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None, "loop_instructions": len(loop),
            "per_weight": len(loop) / weights,
            "top": collections.Counter(opcode(line) for line in loop).most_common(8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    small = te.default_config(3, 16, 4096, 7168)
    large = te.default_config(3, 64, 4096, 7168)
    configs = {"batch<=16": small, "batch<=16 lut": replace(small, lut=True),
               "batch<=16 no swap": replace(small, swap_ab=False), "batch 64": large}
    rows = []
    print(f"sm_{args.arch}, triton {triton.__version__}: main-loop instructions per weight per thread")
    for fmt_name in FORMATS:
        for label, config in configs.items():
            row = {"label": label, **analyse(fmt_name, config, args.arch)}
            rows.append(row)
            top = ", ".join(f"{op} {count}" for op, count in row["top"])
            print(f"{fmt_name:5s} {label:18s} {row['per_weight']:5.1f}  regs {row['registers']}, "
                  f"stack {row['stack_bytes']} B  [{top}]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
