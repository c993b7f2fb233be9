"""cloverlm: block-diffusion Mixture-of-Experts language models (Clover)."""

from .cache import CloverCache
from .config import PRESETS, CloverConfig, preset_config
from .errors import CloverError
from .model import CloverForBlockDiffusion, register_auto_classes

register_auto_classes()

__all__ = ["PRESETS", "CloverCache", "CloverConfig", "CloverError", "CloverForBlockDiffusion", "preset_config"]
