"""moeshrink's low-bit expert kernels and its vLLM plugin.

`experts` computes a MoE layer's routed experts from packed weights (TWX or MXFP4), decoding one
expert at a time with the reference decoders; `triton_experts` does the same on CUDA GPUs with a
Triton kernel that decodes inside the matmul; `vllm` (the plugin) registers the quantization methods
that let vLLM load and serve such checkpoints. Importing this package imports neither vLLM nor triton.
"""

# What the plugin logs once a model's weights are loaded, followed by a JSON object of their bytes;
# the serve stage reads it from the server log (moeshrink.serve.serverlog).
WEIGHTS_LINE = "moeshrink weights:"
# What the CPU expert path logs each time it keeps one more layer's experts decoded (experts.py), followed
# by a JSON object: layers kept, their bytes (beside the packed weights) and the budget.
DECODED_LAYERS_LINE = "moeshrink decoded layers:"
