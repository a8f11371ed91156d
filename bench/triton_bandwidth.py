"""GPU bandwidth of the Triton packed-expert kernel (moeshrink_kernels.triton_experts) on
DeepSeek-V3 expert shapes, against the card's own copy bandwidth measured in the same run.

    python bench/triton_bandwidth.py [--out bench/results] [--experts 32] [--budget 240]

For TWX3, TWX2 and MXFP4, and for w13 [4096, 7168] and w2 [7168, 2048]: first checks each config
it times against the reference decoder (moeshrink.formats.twx / moeshrink.formats.mxfp4, float32 on the GPU), then
times y = x @ W^T at 1, 4, 16 and 64 tokens per expert, for one expert and for `--experts` experts
in one grouped launch (so timings are not launch-bound), trying a few configs and keeping the best.
Effective bandwidth = packed bytes read (codes + scales) / kernel time; dense bf16 (torch matmul on
the decoded weights' shape) is timed alongside. Writes triton_bandwidth.json and .md to --out.

Needs only torch, triton and this repository (puts the repository and kernels/ on sys.path).
`--smoke` runs the same code on tiny shapes in Triton's interpreter on the CPU (TRITON_INTERPRET=1
must be set before start): a check of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402

from moeshrink.formats import mxfp4, twx  # noqa: E402
from moeshrink_kernels import triton_experts as te  # noqa: E402

FORMATS = {"twx3": 3, "twx2": 2, "mxfp4": te.MXFP4}
BITS = {3: 3, 2: 2, te.MXFP4: 4}
HIDDEN, INTER = 7168, 2048
BATCHES = (1, 4, 16, 64)
CHECK_ROWS = 512  # weight rows decoded by the reference for the correctness check


def matrices(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"w13": (2 * inter, hidden), "w2": (hidden, inter)}


def candidates(batch: int) -> list[te.KernelConfig]:
    """Configs tried per batch (split K is added per shape); the best is kept."""
    base = te.KernelConfig
    if batch <= 16:
        configs = [base(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
                   base(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3),
                   base(block_m=16, block_n=128, block_k=128, num_warps=8, num_stages=3),
                   base(block_m=16, block_n=32, block_k=256, num_warps=2, num_stages=4),
                   base(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=False)]
        if batch == 1:
            configs.append(base(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=3, use_dot=False))
    else:
        configs = [base(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3),
                   base(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
                   base(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3),
                   base(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3, swap_ab=False)]
    # levels computed (the default) and gathered from a table
    return configs + [replace(c, lut=True) for c in configs[:2]]


def random_packed(fmt: int, experts: int, n: int, k: int, device: torch.device, generator: torch.Generator):
    """Random codes (every code equally likely) and scales near 2**-6 per block, back to back."""
    row_bytes = k * BITS[fmt] // 8
    codes = torch.randint(0, 256, (experts * n * row_bytes,), dtype=torch.uint8, device=device, generator=generator)
    low, high = (118, 123) if fmt == te.MXFP4 else (104, 120)  # E8M0 2**-9..2**-5; UE5M3 2**-7..2**-6*1.875
    scales = torch.randint(low, high, (experts, n, k // 32), dtype=torch.uint8, device=device, generator=generator)
    offsets = torch.arange(experts, dtype=torch.int64, device=device) * (n * row_bytes)
    return codes, scales, offsets, row_bytes


def reference_rows(fmt: int, codes: torch.Tensor, scales: torch.Tensor, expert: int, n: int, k: int, rows: int,
                   row_bytes: int, device: torch.device) -> torch.Tensor:
    """Expert `expert`'s first `rows` weight rows decoded by the reference decoder (on the CPU)."""
    start = expert * n * row_bytes
    c = codes[start:start + rows * row_bytes].view(rows, row_bytes).cpu()
    s = scales[expert, :rows].cpu()
    decode = mxfp4.decode if fmt == te.MXFP4 else twx.decode
    return decode(c, s, torch.float32).to(device)


class Runner:
    """One grouped launch with prebuilt block tables (no host work inside the timed call)."""

    def __init__(self, x, counts, codes, scales, offsets, n, k, fmt, config):
        from moeshrink_kernels import _triton_packed

        self.kernels, self.x, self.codes, self.scales, self.offsets = _triton_packed, x, codes, scales, offsets
        self.n, self.k, self.fmt, self.config = n, k, fmt, config
        config.check(fmt)
        self.table = te._block_table(counts, config.block_m, [True] * len(counts), x.device)
        self.levels = te._levels(fmt, x.device)
        self.out_dtype = torch.float32 if config.split_k > 1 else x.dtype

    def __call__(self) -> torch.Tensor:
        make = torch.zeros if self.config.split_k > 1 else torch.empty
        out = make(self.x.shape[0], self.n, dtype=self.out_dtype, device=self.x.device)
        self.kernels.launch(self.x, self.codes, self.scales, self.levels, out, *self.table, self.offsets,
                            self.n, self.k, self.fmt, self.config)
        return out


def timer(device: torch.device):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=30, return_mode="median") * 1e-3

    def once(fn):  # the interpreter: one call, timing meaningless
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return once


def copy_bandwidth(device: torch.device, measure, nbytes: int) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = measure(lambda: dst.copy_(src))
    as_float = src.view(torch.float32)
    read_s = measure(lambda: as_float.sum())
    return {"bytes": nbytes, "copy_s": copy_s, "copy_GBps": 2 * nbytes / copy_s / 1e9,
            "read_s": read_s, "read_GBps": nbytes / read_s / 1e9}


def provenance(device: torch.device, args) -> dict:
    import triton

    def git(*command):
        try:
            out = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return out.stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "HEAD") or os.environ.get("MOESHRINK_GIT_COMMIT") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (Triton interpreter on the CPU)"
    return {"script": "bench/triton_bandwidth.py", "argv": sys.argv, "gpu": gpu,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "host": platform.node(), "git_commit": commit,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args)}


def bench_shape(fmt_name: str, matrix: str, n: int, k: int, args, device, measure, deadline: float,
                generator: torch.Generator, log, failures: list[dict]) -> list[dict]:
    """Rows of timings; configs that fail to compile or to match the reference go to `failures`."""
    fmt = FORMATS[fmt_name]
    codes, scales, offsets, row_bytes = random_packed(fmt, args.experts, n, k, device, generator)
    packed_bytes_per_expert = n * row_bytes + n * k // 32
    check = min(1, args.experts - 1)  # the expert checked against the reference: not at offset 0
    reference = reference_rows(fmt, codes, scales, check, n, k, min(CHECK_ROWS, n), row_bytes, device)
    dense = torch.randn(args.experts, n, k, device=device).to(torch.bfloat16) if args.dense else None
    rows = []
    for batch in args.batches:
        best_config = None
        for experts in sorted({args.experts, 1}, reverse=True):  # many experts first: it picks the config
            # one expert: only expert `check` has rows (block tables skip experts without rows)
            counts = [batch] * experts if experts > 1 else [0] * check + [batch]
            x = torch.randn(experts * batch, k, device=device, generator=generator).to(torch.bfloat16)
            checked = slice(check * batch, (check + 1) * batch) if experts > 1 else slice(0, batch)
            expected = x[checked].float() @ reference.T
            blocks = lambda c: experts * -(-batch // c.block_m)  # noqa: E731
            default = te.default_config(fmt, batch, n, k, blocks(te.KernelConfig()), device)
            if best_config is None:
                tried = [default] + [te.with_split_k(c, blocks(c), n, k, device) for c in candidates(batch)]
            else:
                tried = [default, te.with_split_k(replace(best_config, split_k=1), blocks(best_config), n, k, device)]
            results = []
            for config in dict.fromkeys(tried):  # unique, default first
                if time.time() > deadline and results:
                    break
                entry = {"config": asdict(config), "default": config == default}
                try:
                    run = Runner(x, counts, codes, scales, offsets, n, k, fmt, config)
                    got = run()[checked, :reference.shape[0]].float()
                except ValueError:  # a tiling this format cannot use
                    continue
                except Exception as error:  # noqa: BLE001 - e.g. triton's OutOfResources: record, go on
                    failures.append(entry | {"shape": f"{fmt_name} {matrix} batch {batch}", "error": repr(error)})
                    continue
                error = float((got - expected).norm() / expected.norm())
                if not error <= 1e-2:
                    failures.append(entry | {"shape": f"{fmt_name} {matrix} batch {batch}", "relative_error": error})
                    continue
                results.append(entry | {"seconds": measure(run), "relative_error": error})
            if not results:
                log(f"{fmt_name:5s} {matrix:3s} batch {batch:3d} experts {experts:3d}: no config ran correctly")
                continue
            best = min(results, key=lambda r: r["seconds"])
            best_config = best_config or te.KernelConfig(**best["config"])
            total_bytes = experts * packed_bytes_per_expert
            default_seconds = next((r["seconds"] for r in results if r["default"]), None)
            row = {"format": fmt_name, "matrix": matrix, "n": n, "k": k, "batch": batch, "experts": experts,
                   "packed_bytes": total_bytes, "best": best, "default_seconds": default_seconds,
                   "effective_GBps": total_bytes / best["seconds"] / 1e9, "tried": results}
            if dense is not None:
                w = dense[:experts]
                xb = x.view(experts, batch, k)
                row["dense_bf16_seconds"] = measure(lambda: torch.bmm(xb, w.transpose(1, 2)))
                row["dense_bf16_GBps"] = w.numel() * 2 / row["dense_bf16_seconds"] / 1e9
            rows.append(row)
            default_us = (default_seconds or float("nan")) * 1e6
            log(f"{fmt_name:5s} {matrix:3s} batch {batch:3d} experts {experts:3d}: "
                f"best {best['seconds'] * 1e6:9.1f} us ({row['effective_GBps']:7.1f} GB/s packed), "
                f"default {default_us:9.1f} us, {len(results)} configs")
    del codes, scales, dense
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def config_text(config: dict) -> str:
    text = f"m{config['block_m']} n{config['block_n']} k{config['block_k']}"
    if config["split_k"] > 1:
        text += f" split{config['split_k']}"
    text += f" w{config['num_warps']} s{config['num_stages']}"
    text += ("" if config["swap_ab"] else " no-swap") if config["use_dot"] else " no-dot"
    return text + (" lut" if config["lut"] else " alu")


def markdown(result: dict) -> str:
    prov, bw = result["provenance"], result["bandwidth"]
    lines = [f"# Triton packed-expert kernel bandwidth ({prov['gpu']})", "",
             f"torch {prov['torch']}, triton {prov['triton']}, CUDA {prov['cuda']}, commit {prov['git_commit']}, "
             f"{prov['time_utc']}", "",
             f"Copy bandwidth (device-to-device, read + written): **{bw['copy_GBps']:.0f} GB/s**; "
             f"read-only (sum): {bw['read_GBps']:.0f} GB/s.", "",
             "| format | matrix | tokens/expert | experts | best config | us | packed GB/s | % of copy | "
             "% of read | default us | dense bf16 us | dense GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        dense_s, dense_bw = r.get("dense_bf16_seconds"), r.get("dense_bf16_GBps")
        default = "failed" if r["default_seconds"] is None else f"{r['default_seconds'] * 1e6:.1f}"
        lines.append(
            f"| {r['format']} | {r['matrix']} [{r['n']}, {r['k']}] | {r['batch']} | {r['experts']} | "
            f"{config_text(r['best']['config'])} | {r['best']['seconds'] * 1e6:.1f} | {r['effective_GBps']:.0f} | "
            f"{100 * r['effective_GBps'] / bw['copy_GBps']:.0f}% | "
            f"{100 * r['effective_GBps'] / bw['read_GBps']:.0f}% | "
            f"{default} | "
            f"{'-' if dense_s is None else f'{dense_s * 1e6:.1f}'} | "
            f"{'-' if dense_bw is None else f'{dense_bw:.0f}'} |")
    lines += ["", "Target: >= 50% of copy bandwidth at 1-16 tokens per expert (many experts per launch). "
              "Every timed config was first checked against the reference decoder (relative error <= 1e-2)."]
    if result["failures"]:
        lines.append(f"**{len(result['failures'])} config(s) failed** to compile or to match the reference "
                     "(see `failures` in the JSON).")
    if result.get("stopped_early"):
        lines.append("The time budget ran out: some configs were not tried (see the JSON).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--budget", type=float, default=240, help="seconds; later configs are skipped after it")
    parser.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense bf16 baseline")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Triton interpreter (CPU)")
    args = parser.parse_args()
    start = time.time()
    if args.smoke:
        if not te.interpreter_on():
            print("triton_bandwidth.py --smoke: set TRITON_INTERPRET=1 before starting", file=sys.stderr)
            return 2
        device, hidden, inter, copy_bytes = torch.device("cpu"), 256, 64, 1 << 20
        args.experts = min(args.experts, 2)
        args.batches = [1, 64] if args.batches == list(BATCHES) else args.batches  # both config families
    elif not torch.cuda.is_available():
        print("triton_bandwidth.py: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    else:
        device, hidden, inter, copy_bytes = torch.device("cuda"), HIDDEN, INTER, 1 << 30
    measure = timer(device)
    generator = torch.Generator(device=device).manual_seed(0)
    result = {"provenance": provenance(device, args)}
    print(f"{result['provenance']['gpu']}: torch {torch.__version__}, triton {result['provenance']['triton']}")
    result["bandwidth"] = copy_bandwidth(device, measure, copy_bytes)
    print(f"copy {result['bandwidth']['copy_GBps']:.0f} GB/s (read + written), "
          f"read {result['bandwidth']['read_GBps']:.0f} GB/s")
    deadline = start + args.budget
    rows, failures = [], []
    for fmt_name in args.formats:
        for matrix, (n, k) in matrices(hidden, inter).items():
            rows += bench_shape(fmt_name, matrix, n, k, args, device, measure, deadline, generator, print, failures)
    result["rows"], result["failures"] = rows, failures
    result["stopped_early"] = time.time() > deadline
    result["seconds"] = round(time.time() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_bandwidth.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "triton_bandwidth.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.out / 'triton_bandwidth.json'} and .md in {result['seconds']} s")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
