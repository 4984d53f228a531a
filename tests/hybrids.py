"""Tiny hybrid targets (recurrent layers beside attention), one mlx-lm config
per family, shared by the family tests and the hybrid round tests."""

from helpers import draft_config, target_config

HYBRID_SHAPES = {
    # one entry per family, added beside its adapter
    # layers 1 and 3 attend, the others convolve (kernel 3, with biases)
    "lfm2": {
        "model_type": "lfm2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "norm_eps": 1e-5,
        "conv_bias": True, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "full_attn_idxs": [1, 3],
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    # layer kinds from layer_types; layer 0 dense, then 8 sigmoid-routed experts (top 2, biased choice)
    "lfm2_moe": {
        "model_type": "lfm2_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 1, "routed_scaling_factor": 1.5,
        "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 4096, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    },
    # blocks from the pattern: Mamba-2 (8 heads in 2 groups sharing B/C), attention, ReLU² MLP;
    # a time_step_limit that binds, so unclipped step sizes show
    "nemotron_h": {
        "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
        "hybrid_override_pattern": "M*-M*-", "intermediate_size": 128, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "mamba_proj_bias": False, "use_conv_bias": True, "mlp_bias": False, "use_bias": False,
        "layer_norm_epsilon": 1e-5, "time_step_limit": [0.05, 1.5], "tie_word_embeddings": False,
    },
    # layers 2 and 5 gated attention (half of each head rotated), the others delta nets
    # (4 value heads over 2 key heads, Dv != Dk)
    "qwen3_5": {
        "model_type": "qwen3_5", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
        "intermediate_size": 128, "full_attention_interval": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
    # layers 1 and 3 gated attention; every layer a MoE block: 4 experts (top 2) and a gated shared expert
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "full_attention_interval": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
}


def hybrid_draft_config(config: dict, **draft) -> dict:
    """A qwen3 DSpark draft for a hybrid target: the target's vocabulary, width
    and layer count, with attention geometry of its own (drafts are plain
    attention whatever the target's layers)."""
    base = target_config(
        "qwen3", vocab=config["vocab_size"], hidden=config["hidden_size"], layers=config["num_hidden_layers"],
        heads=4, kv_heads=2, head_dim=16,
    )
    return draft_config(base, **draft)
