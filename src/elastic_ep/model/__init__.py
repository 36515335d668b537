"""Pure model code for DeepSeek-V3 and Qwen3-MoE; imports nothing from the rest of elastic_ep
but `errors`.

config       MoEConfig: one normalized view of both Hugging Face configs
checkpoint   CheckpointReader: dense state, and chosen (layer, expert) tensors read alone
model        MoEForCausalLM.forward(chunks, kv_cache, moe_fn): everything but routed experts
attention    MLA and GQA over the padded KV cache; kv_cache: KVCache
router       top-k routing functions; moe: expert math and local_moe_fn
layers       RMSNorm, rotary embedding (default, YaRN), gated MLP
engine       OfflineEngine: continuous batching in one process; sampling: seeded sampling
tiny         make_tiny, resolve_model("tiny-deepseek-v3" | "tiny-qwen3-moe"); tokenizer
"""
