"""Dense decode GEMV (the model's bf16 projections at batch 1..16)."""
from .config import GemvConfig
from .launch import MAX_TOKENS, default_config, default_config_for, dense_gemv, heuristic_config
from .tuned import TUNED_M1

__all__ = ["GemvConfig", "MAX_TOKENS", "default_config", "default_config_for", "dense_gemv",
           "heuristic_config", "TUNED_M1"]
