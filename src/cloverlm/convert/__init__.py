"""From a pretrained base to Clover (docs/design.md section 7): the Llama base from its GGUF, the
Qwen3.5-MoE mapping, the LoRA adapter on disk, loading any model folder, and the autoregressive peer."""
