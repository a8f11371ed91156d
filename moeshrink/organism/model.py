"""The organism's architecture: a small DeepSeek-V3 (MLA, sigmoid router with correction bias, grouped
top-k, shared expert, dense first layer), in the exact config.json form vLLM and transformers load."""
from __future__ import annotations

from moeshrink.organism import OrganismError

# Keys vLLM's CPU build needs to serve DeepseekV3ForCausalLM (see SPEC.md): the MLA cache head must
# be kv_lora_rank 512 + qk_rope_head_dim 64, and the router needs noaux_tc + sigmoid scoring.
FIXED_KEYS = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,
}


def hf_config_dict(model_cfg: dict, vocab_size: int, eos_token_id: int) -> dict:
    """config.json content for the organism, from the `upstream.organism.model` config subtree."""
    heads = model_cfg["num_attention_heads"]
    config = {
        **FIXED_KEYS,
        **{k: v for k, v in model_cfg.items() if k != "rope_theta"},
        "num_key_value_heads": heads,
        "vocab_size": vocab_size,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model_cfg["rope_theta"])},
        "dtype": "bfloat16",
    }
    if model_cfg["n_routed_experts"] % model_cfg["n_group"]:
        raise OrganismError("upstream.organism.model.n_group must divide n_routed_experts")
    return config


def build_model(config: dict, experts_implementation: str = "grouped_mm"):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_config = DeepseekV3Config(**config)
    hf_config._experts_implementation = experts_implementation
    return DeepseekV3ForCausalLM(hf_config)
