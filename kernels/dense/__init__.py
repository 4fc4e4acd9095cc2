"""Dense decode GEMV (the model's bf16 projections at batch 1..16)."""
from .config import GemvConfig  # noqa: F401
from .launch import MAX_TOKENS, default_config, dense_gemv  # noqa: F401
