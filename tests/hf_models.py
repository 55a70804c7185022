"""Tiny Hugging Face causal LMs built from their config classes (no download), for the tests."""

from __future__ import annotations

import torch


def tiny(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64):
    """A tiny causal LM of `kind` (llama: GQA 4 q / 2 kv heads), in eval-free train mode."""
    import transformers as tf

    decoder = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    configs = {
        "llama": lambda: tf.LlamaConfig(**decoder),
        "qwen2": lambda: tf.Qwen2Config(**decoder),
        "qwen3": lambda: tf.Qwen3Config(**decoder, head_dim=8),
        "mistral": lambda: tf.MistralConfig(**decoder, sliding_window=4),
        "gpt2": lambda: tf.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0),
    }
    config = configs[kind]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    return model


def token_batches(steps: int, batch: int, seq: int, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]
