"""vLLM plugin: serves moeshrink's packed expert formats.

- `twx`: TWX3 / TWX2.5 builds (config.json `quantization_config.quant_method: twx`).
- `mxfp4`: `moeshrink_mxfp4`, per-expert MXFP4 checkpoints of DeepSeek-V3-style models on the CPU.
- `loader`: `--load-format moeshrink`, vLLM's safetensors loader plus one log line of weight bytes.
- `ops`: the custom ops both formats' layers call, and the choice of vLLM's CPU MoE kernel.
- `packed`: the MoE method and quantization config both formats derive from.

Routed experts stay packed in memory and are decoded inside a custom op (torch.compile sees one
opaque call): on the CPU the chosen experts are decoded in groups within a byte budget and run
through vLLM's own CPU MoE kernel; on CUDA a Triton kernel decodes inside the matmul. Routing, the
routed scaling factor and shared experts stay vLLM's; everything else in the model is unquantized.
Registered through the `vllm.general_plugins` entry point; registration is idempotent (vLLM calls it
in every process). Importing this package imports neither vLLM nor torch: its modules do, and only
`register` imports them.
"""
from __future__ import annotations

LOAD_FORMAT = "moeshrink"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from moeshrink_kernels import inductor_fix
    from moeshrink_kernels.vllm import loader, mxfp4, ops, twx

    ops.logger.info("moeshrink: torch Inductor fix (mutation renames): %s", inductor_fix.apply())
    register_quantization_config("twx")(twx.TWXConfig)
    register_quantization_config("moeshrink_mxfp4")(mxfp4.MoeshrinkMXFP4Config)
    register_model_loader(LOAD_FORMAT)(loader.WeightCountingLoader)
    ops.register_ops()
    _registered = True
