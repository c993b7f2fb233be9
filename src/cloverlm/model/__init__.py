"""The Clover model (docs/design.md sections 1-3): its config, the block layout of a sequence, the two
layer kinds (memory, attention), the stack as a transformers PreTrainedModel, the decoding cache, and
safetensors checkpoints. Depends on ops/ only."""
