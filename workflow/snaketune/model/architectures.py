"""Sizes of the builtin architectures, apart from snaketune.model.build so that the memory plan (snaketune.plan.search)
can read them without importing torch and transformers (seconds per plan job)."""

# deepseek-ai/deepseek-llm-7b-base config.json (6,910,365,696 parameters).
DEEPSEEK_LLM_7B = dict(
    vocab_size=102400,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=30,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=100000,
    eos_token_id=100001,
)

# Same family at ~1M parameters: the MLP keeps 7B's intermediate/hidden ratio (11008/4096 ~ 2.69).
BUILTIN_TINY = dict(
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
)
