"""LoRA's constants, apart from the adapter's tensors: the run's config reads them without torch."""

# Tinker does not send alpha; like Tinker and SkyRL the adapter output is scaled by alpha / rank with
# alpha = 32, so rank 32 has scale 1 and doubling the rank halves the scale.
LORA_ALPHA = 32.0

# Module-name suffixes per Tinker LoRA group, as Llama/Qwen2/Qwen3 name their linear layers.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
