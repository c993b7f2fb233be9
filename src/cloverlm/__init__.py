"""cloverlm: block-diffusion Mixture-of-Experts language models (Clover)."""

from cloverlm.errors import CloverError
from cloverlm.model.cache import CloverCache
from cloverlm.model.clover import CloverForBlockDiffusion, register_auto_classes
from cloverlm.model.config import PRESETS, CloverConfig, preset_config

register_auto_classes()

__all__ = ["PRESETS", "CloverCache", "CloverConfig", "CloverError", "CloverForBlockDiffusion", "preset_config"]
