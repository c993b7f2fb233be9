"""cloverlm: block-diffusion Mixture-of-Experts language models (Clover)."""

from .config import PRESETS, CloverConfig, preset_config
from .errors import CloverError
from .model import CloverCache, CloverForBlockDiffusion, register_auto_classes

register_auto_classes()

__all__ = ["PRESETS", "CloverCache", "CloverConfig", "CloverError", "CloverForBlockDiffusion", "preset_config"]
