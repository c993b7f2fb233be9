"""Training, in two rooms that share one loop: scratch/ (from-scratch presets) and conversion/ (a
pretrained base converted to Clover: the shipped default). loop.py is their step loop, checkpoints and
resume; distributed.py torchrun data parallelism; calibrate.py fits the block-size head of any Clover
model. Held-out evaluation is cloverlm.evaluation."""
