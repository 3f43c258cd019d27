"""Hugging Face Transformers architectures for the tests: each built from its config at a
small size (hidden 64, 2 layers, vocabulary 128), random weights, dropout off (parity with one
process needs the same arithmetic, not the same random masks); never a hub download.

``ARCHITECTURES`` maps a short name to a builder; ``batch(name, ...)`` makes a batch as HF's
own training loop feeds it: ``input_ids``, ``attention_mask`` with padding on some rows, and
``labels`` (-100 on padding; for encoder-decoder models the decoder's inputs and labels).
"""

import torch
import transformers as T

VOCAB = 128
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=64)

# Every dropout probability a config of these architectures names.
_DROPOUT_FIELDS = ("dropout", "attention_dropout", "hidden_dropout", "hidden_dropout_prob",
                   "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                   "summary_first_dropout", "dropout_rate", "activation_dropout", "classifier_dropout",
                   "pooler_dropout", "ffn_dropout")


def _no_dropout(config):
    for field in _DROPOUT_FIELDS:
        if isinstance(getattr(config, field, None), float):
            setattr(config, field, 0.0)
    return config


def _small(config_class, **overrides):
    return _no_dropout(config_class(**{**SMALL, **overrides}))


ARCHITECTURES = {
    # decoder LMs
    "llama": lambda: T.LlamaForCausalLM(_small(T.LlamaConfig, num_key_value_heads=2)),
    "mistral": lambda: T.MistralForCausalLM(_small(T.MistralConfig, num_key_value_heads=2)),
    "qwen2": lambda: T.Qwen2ForCausalLM(_small(T.Qwen2Config, num_key_value_heads=2)),
    "qwen3": lambda: T.Qwen3ForCausalLM(_small(T.Qwen3Config, num_key_value_heads=2, head_dim=16)),
    "gemma": lambda: T.GemmaForCausalLM(_small(T.GemmaConfig, num_key_value_heads=1, head_dim=16)),
    "gemma2": lambda: T.Gemma2ForCausalLM(_small(T.Gemma2Config, num_key_value_heads=2, head_dim=16)),
    "phi3": lambda: T.Phi3ForCausalLM(_small(T.Phi3Config, num_key_value_heads=2, pad_token_id=0)),
    "phi": lambda: T.PhiForCausalLM(_small(T.PhiConfig)),
    "gpt2": lambda: T.GPT2LMHeadModel(_no_dropout(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                                n_positions=64))),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(_small(T.GPTNeoXConfig)),
    "falcon": lambda: T.FalconForCausalLM(_no_dropout(T.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        new_decoder_architecture=True, num_kv_heads=2))),
    "opt": lambda: T.OPTForCausalLM(_no_dropout(T.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, word_embed_proj_dim=64))),
    "bloom": lambda: T.BloomForCausalLM(_no_dropout(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                                                  vocab_size=VOCAB))),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(_small(T.Starcoder2Config, num_key_value_heads=2)),
    "olmo": lambda: T.OlmoForCausalLM(_small(T.OlmoConfig, num_key_value_heads=2)),
    # encoders (masked LM)
    "bert": lambda: T.BertForMaskedLM(_small(T.BertConfig)),
    "roberta": lambda: T.RobertaForMaskedLM(_small(T.RobertaConfig, pad_token_id=1)),
    "deberta_v2": lambda: T.DebertaV2ForMaskedLM(_small(T.DebertaV2Config)),
    # encoder-decoder
    "t5": lambda: T.T5ForConditionalGeneration(_no_dropout(T.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=VOCAB))),
    "bart": lambda: T.BartForConditionalGeneration(_no_dropout(T.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64))),
    # mixtures of experts (expert parallelism: test_hf_models.py's ep pins)
    "mixtral": lambda: T.MixtralForCausalLM(_small(T.MixtralConfig, num_key_value_heads=2, num_local_experts=4,
                                                   num_experts_per_tok=2)),
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(_small(T.Qwen2MoeConfig, num_key_value_heads=2, num_experts=4,
                                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=64)),
}

ENCODER_DECODER = {"t5", "bart"}


def build(name, seed=0):
    torch.manual_seed(seed)
    return ARCHITECTURES[name]()


def batch(name, size, seq=16, seed=0):
    """A padded batch: rows 1 and 2 (of each 4) end in 4 and 7 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (size, seq), generator=g)
    mask = torch.ones(size, seq, dtype=torch.long)
    for row in range(size):
        pad = (0, 4, 7, 0)[row % 4]
        if pad:
            mask[row, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name in ENCODER_DECODER:
        target = torch.randint(3, VOCAB, (size, seq // 2), generator=g)
        out["decoder_input_ids"] = target
        out["labels"] = target.clone()
    return out
