"""Dense decode GEMV (the model's bf16 projections at batch 1..16)."""
from .config import GemvConfig  # noqa: F401
from .launch import (  # noqa: F401
    MAX_TOKENS,
    call_config,
    default_config,
    dense_gemv,
    heuristic_config,
)
from .tuned import TUNED_M1, TUNED_M1_E4M3  # noqa: F401
