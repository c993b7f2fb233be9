"""Kernels with a pure-PyTorch reference each: the gated delta rule and MoE expert dispatch."""
