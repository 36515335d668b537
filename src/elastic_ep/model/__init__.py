"""Pure model code for DeepSeek-V3 and Qwen3-MoE; imports nothing from the rest of elastic_ep
but `errors`.

config       MoEConfig: one normalized view of both Hugging Face configs (transformers 4.x and 5.x)
checkpoint   CheckpointReader: dense state, and chosen (layer, expert) tensors read alone, in a dtype
model        MoEForCausalLM.forward(chunks, kv_cache, moe_fn): everything but routed experts, on a device
attention    MLA (latent cache, absorbed decode) and GQA over block tables of the paged KV cache
kv_cache     KVCache: the pool of KV blocks; block_manager: BlockManager, who holds which blocks
router       top-k routing functions; moe: expert math and local_moe_fn
layers       RMSNorm, rotary embedding (default, YaRN), gated MLP
engine       OfflineEngine: continuous batching over one KV pool in one process; sampling: seeded sampling
tiny         make_tiny, resolve_model("tiny-deepseek-v3" | "tiny-qwen3-moe"); tokenizer
"""
