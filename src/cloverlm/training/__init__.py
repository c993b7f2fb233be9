"""Training: corpus and task data, the diffusion and conversion objectives, the two trainers (from scratch
and conversion), the block-size head's fit, and torchrun data parallelism (held-out evaluation is
cloverlm.evaluation)."""
