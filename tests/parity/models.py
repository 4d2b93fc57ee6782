"""The tiny models of the parity suite: transformers' own Qwen3-MoE and DeepSeek-V3 classes
with hidden size 256 and 8 routed experts, random init from a fixed seed."""

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelSpec:
    name: str              # transformers' model_type
    config: Callable       # () -> PretrainedConfig
    model_class: Callable  # () -> the *ForCausalLM class
    moe_layer: int         # the MoE layer the reference is checked on (it holds the zero expert)
    seed: int
    vocab: int = 512


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=256,
        architectures=["Qwen3MoeForCausalLM"])


def _deepseek_v3_config():
    from transformers import DeepseekV3Config

    # Layer 0 dense (its MLP's gate/up are a fused group too), layer 1 MoE with a shared expert,
    # noaux_tc routing over 2 groups; multi-head latent attention with a q LoRA rank.
    return DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=256, architectures=["DeepseekV3ForCausalLM"])


def _qwen3_moe_class():
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM


def _deepseek_v3_class():
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


MODELS = {
    "qwen3_moe": ModelSpec("qwen3_moe", _qwen3_moe_config, _qwen3_moe_class, moe_layer=1, seed=35),
    "deepseek_v3": ModelSpec("deepseek_v3", _deepseek_v3_config, _deepseek_v3_class, moe_layer=1,
                             seed=36),
}


def zeroed_expert(spec: ModelSpec) -> int:
    """The routed expert of `spec.moe_layer` whose weights are all zero."""
    return 3


def calibration_ids(spec: ModelSpec) -> torch.Tensor:
    """Random token ids [16, 64]: enough tokens that every non-zero expert is calibrated."""
    g = torch.Generator().manual_seed(spec.seed + 2)
    return torch.randint(0, spec.vocab - 1, (16, 64), generator=g)


def make_tokenizer(spec: ModelSpec):
    """A word-level tokenizer over the model's vocabulary, made here (nothing is downloaded):
    llm-compressor needs one to accept a dataset."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(spec.vocab - 1)}
    vocab["[UNK]"] = spec.vocab - 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]")
