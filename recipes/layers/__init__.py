"""Building blocks shared by the recipes: RMSNorm, RoPE/YaRN, MLA, SwiGLU MLP,
DeepSeekMoE and the pipeline wrappers (embedding, decoder layer, head, loss)."""
