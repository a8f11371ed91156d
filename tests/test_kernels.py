"""The packed-expert kernels against reference decode + dense matmul, and the vLLM plugin's weight
loading and its failures (no server here; serving is in the end-to-end test)."""
import pytest
import torch
import torch.nn.functional as F

from moeshrink.core import expert_formats
from moeshrink.formats import mxfp4, twx
from moeshrink_kernels.experts import TWX_CODECS, TWXLayout, mxfp4_routed_experts, twx_routed_experts

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 6, 2


def reference_moe(x, topk_weights, topk_ids, w13: list[torch.Tensor], w2: list[torch.Tensor]) -> torch.Tensor:
    """Dense: every expert decoded up front, bf16 weights, float32 maths."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e].float() @ x[t].float()
            y = w2[e].float() @ (F.silu(gate_up[:INTER]) * gate_up[INTER:])
            out[t] += topk_weights[t, k] * y
    return out


def routing(tokens: int, generator: torch.Generator):
    logits = torch.randn(tokens, EXPERTS, generator=generator)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return weights, ids.to(torch.int32)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def packed_twx_layer(weights13, weights2, bits, codec=twx):
    layout = TWXLayout.of(bits, HIDDEN, INTER)
    codes13, scales13, codes2, scales2 = [], [], [], []
    for e, b in enumerate(bits):
        c, s = codec.encode(weights13[e], b)
        codes13.append(c.reshape(-1)), scales13.append(s)
        c, s = codec.encode(weights2[e], b)
        codes2.append(c.reshape(-1)), scales2.append(s)
    return (torch.cat(codes13), torch.stack(scales13), torch.cat(codes2), torch.stack(scales2), layout)


def packed_and_decoded(weights13, weights2, bits=(3, 2, 3, 3, 2, 2), codec=twx):
    """A TWX2.5-like layer (mixed widths) packed, and each expert's reference decode in bf16."""
    decoded13 = [codec.decode(*codec.encode(w, b), torch.bfloat16) for w, b in zip(weights13, bits)]
    decoded2 = [codec.decode(*codec.encode(w, b), torch.bfloat16) for w, b in zip(weights2, bits)]
    return packed_twx_layer(weights13, weights2, list(bits), codec), decoded13, decoded2


@pytest.mark.parametrize("source", ["random", "organism"])
def test_twx_experts_match_reference_decode_and_matmul(source, published):
    generator = torch.Generator().manual_seed(0)
    if source == "random":
        weights13 = [torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.05 for _ in range(EXPERTS)]
        weights2 = [torch.randn(HIDDEN, INTER, generator=generator) * 0.05 for _ in range(EXPERTS)]
    else:  # the tiny organism's own experts, decoded from its MXFP4 files
        from safetensors import safe_open

        from moeshrink.core.checkpoint import index_of

        folder, _ = published
        weight_map = index_of(folder)["weight_map"]

        def expert(e, projection):
            name = f"model.layers.1.mlp.experts.{e}.{projection}.weight"
            with safe_open(str(folder / weight_map[name]), "pt") as f:
                return mxfp4.decode(f.get_tensor(name), f.get_tensor(name + "_scale"), torch.float32)

        shape = expert(0, "gate_proj").shape
        if shape != (INTER, HIDDEN):
            pytest.skip(f"organism experts are {tuple(shape)}")
        weights13 = [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(EXPERTS)]
        weights2 = [expert(e, "down_proj") for e in range(EXPERTS)]
    (codes13, scales13, codes2, scales2, layout), decoded13, decoded2 = packed_and_decoded(weights13, weights2)
    x = torch.randn(9, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(9, generator)
    got = twx_routed_experts(x, topk_weights, topk_ids, codes13, scales13, codes2, scales2, layout.as_tensor())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert relative_error(got, reference_moe(x, topk_weights, topk_ids, decoded13, decoded2)) <= 1e-2


def test_mxfp4_experts_match_reference_decode_and_matmul():
    generator = torch.Generator().manual_seed(1)
    pairs13 = [mxfp4.encode(torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.05) for _ in range(EXPERTS)]
    pairs2 = [mxfp4.encode(torch.randn(HIDDEN, INTER, generator=generator) * 0.05) for _ in range(EXPERTS)]
    x = torch.randn(7, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(7, generator)
    got = mxfp4_routed_experts(x, topk_weights, topk_ids, torch.stack([p[0] for p in pairs13]),
                               torch.stack([p[1] for p in pairs13]), torch.stack([p[0] for p in pairs2]),
                               torch.stack([p[1] for p in pairs2]))
    expected = reference_moe(x, topk_weights, topk_ids, [mxfp4.decode(*p) for p in pairs13],
                             [mxfp4.decode(*p) for p in pairs2])
    assert relative_error(got, expected) <= 1e-2


# ----------------------------------------------------------------------------------- the plugin
@pytest.fixture(scope="module")
def plugin():
    """The plugin's modules, once it has registered itself."""
    from types import SimpleNamespace

    from moeshrink_kernels import vllm as plugin_package

    plugin_package.register()
    plugin_package.register()  # idempotent: vLLM calls it in every process
    from moeshrink_kernels.vllm import loader, mxfp4, ops, packed, twx

    return SimpleNamespace(ops=ops, packed=packed, twx=twx, mxfp4=mxfp4, loader=loader)


def moe_config(experts: int = EXPERTS, hidden: int = HIDDEN, intermediate: int = INTER):
    """vLLM's own description of an unparallelised DeepSeek-V3 MoE layer, as the model builds it."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    return FusedMoEConfig(num_experts=experts, experts_per_token=TOP_K, hidden_dim=hidden,
                          intermediate_size=intermediate, num_local_experts=experts, num_logical_experts=experts,
                          activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.DeepSeekV3,
                          moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)


def plain_vllm_moe(x, topk_weights, topk_ids, w13: list[torch.Tensor], w2: list[torch.Tensor], isa: str):
    """What vLLM computes for the decoded twin served plainly: every expert in bf16, prepacked once,
    through its CPU kernel."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    out = torch.empty_like(x)
    cpu_fused_moe(out, x, cpu_prepack_moe_weight(torch.stack(w13).to(torch.bfloat16), isa),
                  cpu_prepack_moe_weight(torch.stack(w2).to(torch.bfloat16), isa), None, None,
                  topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous(), "silu", isa)
    return out


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("path", ["kept", "one group", "groups of two"])
def test_grouped_kernel_path_computes_what_the_twin_computes(plugin, path, version, monkeypatch):
    """The layer kept decoded, and the chosen experts decoded in one group, give vLLM's own bits for the
    decoded weights; with a decode budget of two experts the path decodes in groups and stays within bf16
    rounding (TWX v1 and v2)."""
    from moeshrink_kernels import experts

    kernel = plugin.ops.cpu_kernel_for(moe_config())
    assert kernel.isa and kernel.padded_intermediate == INTER
    budget_experts = 2 if path == "groups of two" else None
    if path != "kept":
        monkeypatch.setenv("MOESHRINK_DECODED_LAYERS_MIB", "0")
    if budget_experts:
        monkeypatch.setenv("MOESHRINK_DECODE_BUDGET_MIB", str(budget_experts * 3 * INTER * HIDDEN * 2 / 2**20))
    layers_before = experts.decoded_layers_bytes()
    generator = torch.Generator().manual_seed(4)
    weights13 = [torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.05 for _ in range(EXPERTS)]
    weights2 = [torch.randn(HIDDEN, INTER, generator=generator) * 0.05 for _ in range(EXPERTS)]
    (codes13, scales13, codes2, scales2, layout), decoded13, decoded2 = packed_and_decoded(
        weights13, weights2, codec=TWX_CODECS[version])
    x = torch.randn(11, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(11, generator)
    got = twx_routed_experts(x, topk_weights, topk_ids, codes13, scales13, codes2, scales2, layout.as_tensor(), kernel,
                             version)
    twin = plain_vllm_moe(x, topk_weights, topk_ids, decoded13, decoded2, kernel.isa)
    if budget_experts is None:
        assert torch.equal(got, twin)
    else:
        assert relative_error(got, twin.float()) <= 1e-2
    assert relative_error(got, reference_moe(x, topk_weights, topk_ids, decoded13, decoded2)) <= 1e-2
    kept_bytes = EXPERTS * 3 * INTER * HIDDEN * 2  # bf16
    assert experts.decoded_layers_bytes() - layers_before == (kept_bytes if path == "kept" else 0)
    again = twx_routed_experts(x, topk_weights, topk_ids, codes13, scales13, codes2, scales2, layout.as_tensor(),
                               kernel, version)
    assert torch.equal(again, got) and experts.decoded_layers_bytes() - layers_before == (
        kept_bytes if path == "kept" else 0)

    pairs13 = [mxfp4.encode(w) for w in weights13]
    pairs2 = [mxfp4.encode(w) for w in weights2]
    got = mxfp4_routed_experts(x, topk_weights, topk_ids, torch.stack([p[0] for p in pairs13]),
                               torch.stack([p[1] for p in pairs13]), torch.stack([p[0] for p in pairs2]),
                               torch.stack([p[1] for p in pairs2]), kernel)
    twin = plain_vllm_moe(x, topk_weights, topk_ids, [mxfp4.decode(*p) for p in pairs13],
                          [mxfp4.decode(*p) for p in pairs2], kernel.isa)
    if budget_experts is None:
        assert torch.equal(got, twin)
    else:
        assert relative_error(got, twin.float()) <= 1e-2


def quant_config(**changes) -> dict:
    config = {"quant_method": "twx", "format": "twx2.5", "format_version": 1, "group_size": 32,
              "scale_encoding": "ue5m3", "expert_bits": {"1": {str(e): b for e, b in enumerate([3, 2, 3, 3, 2, 2])}}}
    return {**config, **changes}


def test_unknown_format_version_fails_at_load(plugin):
    from vllm.model_executor.layers.quantization import get_quantization_config

    with pytest.raises(plugin.packed.PackedExpertsError,
                       match=r"format_version 3: this plugin reads TWX format versions \[1, 2\]"):
        get_quantization_config("twx").from_config(quant_config(format_version=3))


def test_v2_with_other_codebooks_fails_at_load(plugin):
    from vllm.model_executor.layers.quantization import get_quantization_config

    with pytest.raises(plugin.packed.PackedExpertsError, match=r"codebook\.sha256 is '0+'; this plugin decodes TWX v2"):
        get_quantization_config("twx").from_config(quant_config(format_version=2, codebook={"sha256": "0" * 64}))


def test_each_version_has_its_own_tensor_names_when_the_config_names_none(plugin):
    from vllm.model_executor.layers.quantization import get_quantization_config

    from moeshrink.formats import twx_vq

    read = get_quantization_config("twx").from_config
    assert read(quant_config()).tensors == {"codes": "twx_codes", "scales": "twx_scales"}
    v2 = read(quant_config(format_version=2, codebook={"sha256": twx_vq.codebook_sha256()}))
    assert v2.tensors == {"codes": "tw2_codes", "scales": "tw2_scales"} and v2.version == 2


@pytest.mark.parametrize("version", [1, 2])
def test_loader_places_each_expert_and_names_a_misshapen_tensor(plugin, version):
    twx_method = plugin.twx.TWXExpertsMethod
    bits = [3, 2, 3, 3, 2, 2]
    fmt = expert_formats.get("twx2.5" if version == 1 else "twx2.5-v2", "test")
    codec, codes_name, scales_name = fmt.codec_module(), fmt.codes_suffix, fmt.scales_suffix
    method = twx_method(moe_config(), bits, "model.layers.1.mlp.experts", version,
                        {"codes": codes_name, "scales": scales_name})
    layer = torch.nn.Module()
    method.create_weights(layer, EXPERTS, HIDDEN, INTER, torch.bfloat16, weight_loader=None,
                          unpadded_hidden_size=HIDDEN, global_num_experts=EXPERTS)
    generator = torch.Generator().manual_seed(2)
    weights13 = [torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.05 for _ in range(EXPERTS)]
    weights2 = [torch.randn(HIDDEN, INTER, generator=generator) * 0.05 for _ in range(EXPERTS)]
    for e, b in enumerate(bits):  # as the checkpoint stores them: gate, up and down separately
        for projection, shard, weight in (("gate_proj", "w1", weights13[e][:INTER]), ("up_proj", "w3", weights13[e][INTER:]),
                                          ("down_proj", "w2", weights2[e])):
            codes, scales = codec.encode(weight, b)
            prefix = "w13" if shard != "w2" else "w2"
            for suffix, tensor in ((codes_name, codes), (scales_name, scales)):
                param = getattr(layer, f"{prefix}_{suffix}")
                param.weight_loader(param, tensor, f"model.layers.1.mlp.experts.{e}.{projection}.{suffix}", shard, e)
    w13_codes, w13_scales = getattr(layer, f"w13_{codes_name}"), getattr(layer, f"w13_{scales_name}")
    w2_codes, w2_scales = getattr(layer, f"w2_{codes_name}"), getattr(layer, f"w2_{scales_name}")
    assert torch.equal(w2_codes, packed_twx_layer(weights13, weights2, bits, codec)[2])
    decoded13 = [torch.cat([codec.decode(*codec.encode(w[:INTER], b), torch.bfloat16),
                            codec.decode(*codec.encode(w[INTER:], b), torch.bfloat16)]) for w, b in zip(weights13, bits)]
    decoded2 = [codec.decode(*codec.encode(w, b), torch.bfloat16) for w, b in zip(weights2, bits)]
    x = torch.randn(5, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(5, generator)
    got = twx_routed_experts(x, topk_weights, topk_ids, w13_codes, w13_scales, w2_codes, w2_scales, layer.twx_layout,
                             version=version)
    assert relative_error(got, reference_moe(x, topk_weights, topk_ids, decoded13, decoded2)) <= 1e-2
    wrong = torch.zeros(INTER, HIDDEN * 3 // 8 + 1, dtype=torch.uint8)
    with pytest.raises(plugin.packed.PackedExpertsError,
                       match=rf"experts\.0\.gate_proj\.{codes_name}: expected torch.uint8"):
        w13_codes.weight_loader(w13_codes, wrong, f"model.layers.1.mlp.experts.0.gate_proj.{codes_name}", "w1", 0)


def test_mxfp4_loader_places_gate_up_and_down(plugin):
    mxfp4_method = plugin.mxfp4.MXFP4ExpertsMethod
    method = mxfp4_method(moe_config(), "model.layers.1.mlp.experts")
    layer = torch.nn.Module()
    method.create_weights(layer, EXPERTS, HIDDEN, INTER, torch.bfloat16, weight_loader=None)
    generator = torch.Generator().manual_seed(3)
    weights13, weights2 = [], []
    for e in range(EXPERTS):
        gate, up, down = (torch.randn(*shape, generator=generator) * 0.05
                          for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)))
        for projection, shard, weight in (("gate_proj", "w1", gate), ("up_proj", "w3", up), ("down_proj", "w2", down)):
            packed, scales = mxfp4.encode(weight)
            prefix = "w2" if shard == "w2" else "w13"
            for suffix, tensor in (("weight", packed), ("weight_scale", scales)):
                param = getattr(layer, f"{prefix}_{suffix}")
                assert param.weight_loader(param, tensor, f"experts.{e}.{projection}.{suffix}", shard, e,
                                           return_success=True)
        weights13.append(torch.cat([mxfp4.decode(*mxfp4.encode(gate)), mxfp4.decode(*mxfp4.encode(up))]))
        weights2.append(mxfp4.decode(*mxfp4.encode(down)))
    x = torch.randn(6, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = routing(6, generator)
    got = mxfp4_routed_experts(x, topk_weights, topk_ids, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                               layer.w2_weight_scale)
    assert relative_error(got, reference_moe(x, topk_weights, topk_ids, weights13, weights2)) <= 1e-2


def test_weight_count_says_how_vllm_cpu_holds_a_layer(plugin):
    """vLLM's own CPU GEMM dispatch on a bf16 layer: packed where oneDNN (or sgl-kernel) takes bf16
    (Parameter emptied, the packed copy counted outside the parameters), kept where it does not; the
    kind is the one the planner predicts from what torch reports, and the bytes in memory are the
    layer's either way."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from moeshrink.core.machine import cpu_facts
    from moeshrink.serve import memory

    model = torch.nn.Module()
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(torch.randn(64, 128).to(torch.bfloat16), requires_grad=False)
    loaded = {id(model.proj): 64 * 128 * 2}
    dispatch_cpu_unquantized_gemm(model.proj, remove_weight=True)
    held = plugin.loader.cpu_holdings(model, loaded)
    predicted = memory.cpu_kind(cpu_facts(), {"dtype": "bfloat16"})
    assert held["kind"] == ("packed" if predicted == "amx" else predicted)  # no MLA layer: no AMX_MLA
    assert held["resident_bytes"] == 64 * 128 * 2
    assert held["packed_outside_parameters_bytes"] == (0 if predicted == "unpacked" else 64 * 128 * 2)
