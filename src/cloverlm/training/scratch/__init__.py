"""Training from scratch (`clover train`): corpus and task data, per-block masking and the 1/t-weighted
ELBO, recipes with the next-token warm-up, Clover's and the autoregressive peer's losses, held-out probes.
The presets up to clover-35b-a3b, for GPU clusters (docs/design.md sections 2-3)."""
