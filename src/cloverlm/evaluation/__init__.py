"""Evaluation on held-out prompts: the held-out examples, their encoding and answer budget (heldout.py)
and the per-task evaluator for Clover and its autoregressive peer (evaluate.py). Training, bench, demo
and the cli read these; this package imports none of them."""
