"""Speed and memory of the compression stage on a DeepSeek-V3-shaped MXFP4 checkpoint that this
script generates (default: about 4.3 GB in 8 shards; random codes, the real layout and names).

    python bench/compress_speed.py [--workdir /tmp/moeshrink-bench] [--json bench/results/compress_speed.json]

Prints, each against a baseline measured in the same run:
- prune (router_sum, keep 25%, the whole CLI path: plan, every shard with its sha256, gather) wall
  time over a plain copy of the bytes the pruned build keeps (os.pread/os.write of the same
  tensors' ranges, nothing else), both with the page cache warm, alternated, best of each;
- peak RSS of one shard job (prune and TWX3, each in a fresh process) over that shard's size + 1 GiB
  (target: <= 1.5 x shard + 1 GiB);
- TWX3 / TWX2 quantize throughput in source GB/s per core (one thread), and the reference
  decoder's throughput beside it (one thread, TWX bytes read per second);
- TWX v2's encoder on the first `--v2-tensors` of the same weights, against v1's on those weights
  (issue 19: v2 no slower than v1), as a build's shard job runs it (loading the encoder table the
  run writes once, whose writing time is printed beside), in a process without that table, and with
  its error weighted by input-column importance (seeded random values: the time does not depend on them).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from moeshrink.core.checkpoint import INDEX_FILE, build_manifest, read_header, write_manifest
from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.core.shardio import data_start, save_shard
from moeshrink.formats import twx, twx_vq

GIB = 1 << 30
SHAPE = {"hidden_size": 2048, "moe_intermediate_size": 1024, "intermediate_size": 4096, "n_routed_experts": 64,
         "num_hidden_layers": 21, "first_k_dense_replace": 1, "n_group": 8, "topk_group": 4,
         "num_experts_per_tok": 8, "vocab_size": 32000, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
         "qk_nope_head_dim": 128, "v_head_dim": 128, "num_attention_heads": 16, "q_lora_rank": 1536}


# ------------------------------------------------------------------------------------ checkpoint
def bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)


def mxfp4_pair(rows: int, cols: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scales = torch.randint(116, 124, (rows, cols // 32), dtype=torch.uint8, generator=generator)
    return codes, scales


def layer_tensors(layer: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["n_routed_experts"]
    heads, qk = SHAPE["num_attention_heads"], SHAPE["qk_nope_head_dim"] + SHAPE["qk_rope_head_dim"]
    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "self_attn.q_a_proj.weight": bf16(SHAPE["q_lora_rank"], h, generator=generator),
        p + "self_attn.q_a_layernorm.weight": torch.ones(SHAPE["q_lora_rank"], dtype=torch.bfloat16),
        p + "self_attn.q_b_proj.weight": bf16(heads * qk, SHAPE["q_lora_rank"], generator=generator),
        p + "self_attn.kv_a_proj_with_mqa.weight": bf16(SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"], h,
                                                        generator=generator),
        p + "self_attn.kv_a_layernorm.weight": torch.ones(SHAPE["kv_lora_rank"], dtype=torch.bfloat16),
        p + "self_attn.kv_b_proj.weight": bf16(heads * (SHAPE["qk_nope_head_dim"] + SHAPE["v_head_dim"]),
                                               SHAPE["kv_lora_rank"], generator=generator),
        p + "self_attn.o_proj.weight": bf16(h, heads * SHAPE["v_head_dim"], generator=generator),
    }
    if layer < SHAPE["first_k_dense_replace"]:
        for proj, shape in (("gate_proj", (SHAPE["intermediate_size"], h)), ("up_proj", (SHAPE["intermediate_size"], h)),
                            ("down_proj", (h, SHAPE["intermediate_size"]))):
            out[p + f"mlp.{proj}.weight"] = bf16(*shape, generator=generator)
        return out
    out[p + "mlp.gate.weight"] = bf16(e, h, generator=generator)
    out[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32)
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        out[p + f"mlp.shared_experts.{proj}.weight"] = bf16(*shape, generator=generator)
    for expert in range(e):
        for proj, (rows, cols) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            codes, scales = mxfp4_pair(rows, cols, generator)
            out[p + f"mlp.experts.{expert}.{proj}.weight"] = codes
            out[p + f"mlp.experts.{expert}.{proj}.weight_scale"] = scales
    return out


def generate(folder: Path, shards: int) -> dict:
    """Write the checkpoint (layers split evenly over the shards) with its index and manifest."""
    if (folder / "manifest.json").exists():
        return read_json(folder / "manifest.json")
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    layers = list(range(SHAPE["num_hidden_layers"]))
    per_shard = [layers[i::shards] for i in range(shards)]
    weight_map = {}
    for index, shard_layers in enumerate(per_shard):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for layer in shard_layers:
            tensors.update(layer_tensors(layer, generator))
        if index == 0:
            tensors["model.embed_tokens.weight"] = bf16(SHAPE["vocab_size"], SHAPE["hidden_size"], generator=generator)
            tensors["model.norm.weight"] = torch.ones(SHAPE["hidden_size"], dtype=torch.bfloat16)
            tensors["lm_head.weight"] = bf16(SHAPE["vocab_size"], SHAPE["hidden_size"], generator=generator)
        save_shard(tensors, folder / name, {"format": "pt"})
        weight_map.update({t: name for t in tensors})
        del tensors
    total = sum((folder / n).stat().st_size for n in set(weight_map.values()))
    atomic_write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **SHAPE,
              "hidden_act": "silu", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
              "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rms_norm_eps": 1e-6,
              "quantization_config": {"quant_method": "mxfp4"}}
    atomic_write_json(folder / "config.json", config)
    manifest = {**build_manifest(folder, {"kind": "bench"}), "revision": "bench"}
    write_manifest(folder, manifest)
    return manifest


# -------------------------------------------------------------------------------------- measures
def read_all(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def plain_copy(source: Path, build: Path, out: Path) -> tuple[float, int]:
    """Copy, tensor by tensor, the byte ranges of every tensor the pruned build holds."""
    kept = set(read_json(build / INDEX_FILE)["weight_map"])
    out.mkdir(parents=True, exist_ok=True)
    copied = 0
    start = time.perf_counter()
    for shard in sorted(source.glob("*.safetensors")):
        header, base = read_header(shard), data_start(shard)
        source_fd = os.open(shard, os.O_RDONLY)
        target_fd = os.open(out / shard.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name, entry in header.items():
                if name == "__metadata__" or name not in kept:
                    continue
                begin, end = entry["data_offsets"]
                data = os.pread(source_fd, end - begin, base + begin)
                os.write(target_fd, data)
                copied += len(data)
        finally:
            os.close(source_fd)
            os.close(target_fd)
    return time.perf_counter() - start, copied


PEAK_RSS = ("import re; print('VmHWM', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1])")


def peak_rss_of(code: str, *args: str) -> int:
    """Peak RSS (bytes) of `code` run in a fresh interpreter, read from its own /proc/self/status
    (VmHWM), which unlike ru_maxrss does not count the parent's pages the child was forked with."""
    result = subprocess.run([sys.executable, "-c", f"{code}\n{PEAK_RSS}", *args], capture_output=True, text=True,
                            check=True)
    return int(result.stdout.split("VmHWM")[-1]) * 1024


def shard_job_rss(source: Path, plan: Path, shard: str, out: Path) -> int:
    """Peak RSS of one shard job, as the workflow runs it."""
    code = ("import sys; from pathlib import Path; from moeshrink import stages; "
            "from moeshrink.core.ioutil import read_json; "
            "s = Path(sys.argv[1]); stages.build_shard(s, read_json(s / 'manifest.json'), sys.argv[2], Path(sys.argv[3]), "
            "Path(sys.argv[4]))")
    return peak_rss_of(code, str(source), shard, str(plan), str(out))


def interpreter_rss() -> int:
    return peak_rss_of("import torch, safetensors, moeshrink.compress.builder")


def v2_first_process_seconds(source: Path, shard: str, names: list[str], bits: int) -> float:
    """v2's encoder on these weights in a process with no table: it searches each pair as it first comes."""
    from moeshrink.formats.source_experts import read_expert_weight

    twx_vq.forget_encoder_tables()
    start = time.perf_counter()
    with safe_open(str(source / shard), "pt") as f:
        for name in names:
            twx_vq.encode(read_expert_weight(f, name, "mxfp4"), bits)
    return time.perf_counter() - start


def quantize_throughput(source: Path, shard: str, bits: int, limit: int, v2_limit: int, table: Path) -> dict:
    """Encode and decode up to `limit` expert weights of one shard on one thread; v2 encodes the first
    `v2_limit` of them, as a build's shard job does: with the table its run wrote once (`table`), which
    it loads first (counted in its time)."""
    from moeshrink.formats.source_experts import read_expert_weight

    torch.set_num_threads(1)
    twx_vq.forget_encoder_tables()
    start = time.perf_counter()
    twx_vq.write_encoder_table(bits, table)
    table_write_s = time.perf_counter() - start
    twx_vq.forget_encoder_tables()
    start = time.perf_counter()
    twx_vq.load_encoder_table(table)
    encode_s = decode_s = plain_s = v1_on_v2_s = weighted_s = 0.0
    v2_s = time.perf_counter() - start
    source_bytes = twx_bytes = weights = v2_weights = 0
    with safe_open(str(source / shard), "pt") as f:
        names = [n for n in f.keys() if ".mlp.experts." in n and n.endswith(".weight")][:limit]
        for position, name in enumerate(names):
            start = time.perf_counter()
            weight = read_expert_weight(f, name, "mxfp4")
            codes, scales = twx.encode(weight, bits)
            seconds = time.perf_counter() - start
            encode_s += seconds
            if position < v2_limit:  # both timings include reading and decoding the MXFP4 source
                v1_on_v2_s += seconds
                start = time.perf_counter()
                twx_vq.encode(read_expert_weight(f, name, "mxfp4"), bits)
                v2_s += time.perf_counter() - start
                v2_weights += weight.numel()
                importance = torch.rand(weight.shape[1], generator=torch.Generator().manual_seed(position)) ** 4
                start = time.perf_counter()
                twx_vq.encode(read_expert_weight(f, name, "mxfp4"), bits, importance=importance)
                weighted_s += time.perf_counter() - start
            start = time.perf_counter()
            plain = twx.encode_plain(weight, bits)
            plain_s += time.perf_counter() - start
            if not (torch.equal(plain[0], codes) and torch.equal(plain[1], scales)):
                raise SystemExit(f"{name}: the encoder and its plain-torch oracle disagree")
            source_bytes += f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1] + \
                f.get_slice(name + "_scale").get_shape()[0] * f.get_slice(name + "_scale").get_shape()[1]
            start = time.perf_counter()
            twx.decode(codes, scales, torch.bfloat16)
            decode_s += time.perf_counter() - start
            twx_bytes += codes.numel() + scales.numel()
            weights += weight.numel()
    first_process_s = v2_first_process_seconds(source, shard, names[:v2_limit], bits) if v2_limit else 0.0
    torch.set_num_threads(os.cpu_count() or 1)
    return {"bits": bits, "tensors": len(names), "weights": weights,
            "encode_source_gb_per_s_per_core": source_bytes / encode_s / 1e9,
            "decode_twx_gb_per_s_per_core": twx_bytes / decode_s / 1e9,
            "encode_gweights_per_s_per_core": weights / encode_s / 1e9,
            "plain_torch_encode_gweights_per_s_per_core": weights / plain_s / 1e9,
            "encode_speedup_over_plain_torch": plain_s / encode_s,
            "decode_gweights_per_s_per_core": weights / decode_s / 1e9,
            "v2": {"tensors": min(v2_limit, len(names)), "weights": v2_weights,
                   "encode_gweights_per_s_per_core": v2_weights / v2_s / 1e9 if v2_s else None,
                   "v1_encode_gweights_per_s_per_core": v2_weights / v1_on_v2_s / 1e9 if v1_on_v2_s else None,
                   "v2_over_v1_encode_seconds": v2_s / v1_on_v2_s if v1_on_v2_s else None, "target": 1.0,
                   "table_write_seconds_once_per_run": table_write_s,
                   "activation_weighted_over_v1_encode_seconds": weighted_s / v1_on_v2_s if v1_on_v2_s else None,
                   "without_table_over_v1_encode_seconds": first_process_s / v1_on_v2_s if v1_on_v2_s else None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeshrink-bench"))
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--quantize-tensors", type=int, default=48, help="expert weights timed for throughput")
    parser.add_argument("--v2-tensors", type=int, default=4, help="of those, how many TWX v2 also encodes")
    parser.add_argument("--repeats", type=int, default=3, help="prune and copy runs, alternated; best of each")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint for the next run")
    args = parser.parse_args()
    from moeshrink import stages

    prov = Provenance("bench_compress_speed", {"shape": SHAPE, "shards": args.shards})
    source, results = args.workdir / "upstream", {}
    start = time.perf_counter()
    manifest = generate(source, args.shards)
    results["generate_seconds"] = time.perf_counter() - start
    results["checkpoint_bytes"] = manifest["total_bytes"]
    print(f"checkpoint: {manifest['total_bytes'] / 1e9:.2f} GB in {manifest['shard_count']} shards")

    pruned = args.workdir / "pruned"
    build = {"label": "bench", "prune": {"method": "router_sum", "keep_fraction": 0.25}}
    read_all(source)
    prune_times, copy_times = [], []
    for _ in range(args.repeats):  # alternate, best of each: page-cache writeback adds noise to both
        shutil.rmtree(pruned, ignore_errors=True)
        start = time.perf_counter()
        stages.build_folder("pruned", build, source, pruned)
        prune_times.append(time.perf_counter() - start)
        copy_s, copied = plain_copy(source, pruned, args.workdir / "copy")
        copy_times.append(copy_s)
        shutil.rmtree(args.workdir / "copy", ignore_errors=True)
    prune_s, copy_s = min(prune_times), min(copy_times)
    results["prune"] = {"seconds": prune_s, "plain_copy_seconds": copy_s, "kept_bytes": copied,
                        "all_seconds": prune_times, "all_plain_copy_seconds": copy_times,
                        "ratio": prune_s / copy_s, "target": 1.5}
    print(f"prune 25%: {prune_s:.2f} s; plain copy of the {copied / 1e9:.2f} GB kept: {copy_s:.2f} s; "
          f"ratio {prune_s / copy_s:.2f} (target <= 1.5)")

    largest = max(manifest["shards"], key=lambda s: s["bytes"])
    base_rss = interpreter_rss()
    twx3 = args.workdir / "twx3"
    shutil.rmtree(twx3, ignore_errors=True)
    stages.build_plan("twx3", {"label": "t", "quantize": {"format": "twx3"}}, source, manifest, twx3 / "plan.json")
    rss = {"interpreter_bytes": base_rss, "shard_bytes": largest["bytes"]}
    for job, plan in (("prune", pruned / "plan.json"), ("twx3", twx3 / "plan.json")):
        peak = shard_job_rss(source, plan, largest["file"], args.workdir / f"rss-{job}.safetensors")
        (args.workdir / f"rss-{job}.safetensors").unlink()
        limit = 1.5 * largest["bytes"] + GIB
        rss[job] = {"peak_bytes": peak, "limit_bytes": limit, "ratio_to_limit": peak / limit}
        print(f"{job} shard job: peak RSS {peak / GIB:.2f} GiB for a {largest['bytes'] / GIB:.2f} GiB shard "
              f"(limit 1.5 x shard + 1 GiB = {limit / GIB:.2f} GiB; ratio {peak / limit:.2f}; "
              f"bare interpreter {base_rss / GIB:.2f} GiB)")
    results["rss"] = rss

    results["throughput"] = []
    for bits in (3, 2):
        figures = quantize_throughput(source, largest["file"], bits, args.quantize_tensors, args.v2_tensors,
                                      args.workdir / f"twx_vq-{bits}bit.safetensors")
        results["throughput"].append(figures)
        print(f"TWX{bits} quantize: {figures['encode_source_gb_per_s_per_core']:.3f} source GB/s per core; "
              f"reference decode: {figures['decode_twx_gb_per_s_per_core']:.3f} TWX GB/s per core "
              f"({figures['decode_gweights_per_s_per_core']:.3f} G weights/s against "
              f"{figures['encode_gweights_per_s_per_core']:.3f} encoded); the plain-torch search on the same "
              f"weights: {figures['plain_torch_encode_gweights_per_s_per_core']:.4f} G weights/s, "
              f"speed-up {figures['encode_speedup_over_plain_torch']:.2f}x, bit-identical")
        v2 = figures["v2"]
        if v2["tensors"]:
            print(f"TWX{bits} v2 quantize, {v2['tensors']} of those tensors: {v2['encode_gweights_per_s_per_core']:.4f} "
                  f"G weights/s per core against v1's {v2['v1_encode_gweights_per_s_per_core']:.4f} on the same "
                  f"tensors: v2 takes {v2['v2_over_v1_encode_seconds']:.2f}x v1's time (target <= 1), loading "
                  f"the encoder table its run writes once ({v2['table_write_seconds_once_per_run']:.1f} s); "
                  f"{v2['without_table_over_v1_encode_seconds']:.1f}x in a process without the table; with "
                  f"activation-weighted error (quantize.output_aware: encoder; the table loaded): "
                  f"{v2['activation_weighted_over_v1_encode_seconds']:.1f}x")
    if args.json:
        atomic_write_json(args.json, {**results, "provenance": prov.record()})
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    ok = results["prune"]["ratio"] <= 1.5 and all(rss[j]["ratio_to_limit"] <= 1 for j in ("prune", "twx3"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
