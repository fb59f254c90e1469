"""fx-fusion: a torch.compile pass that fuses multi-layer draft K/V materialization."""

from fx_fusion.kernels.ops import fused_norm_rope_stacked

from .backend import fx_fusion_backend  # registers backend="fx_fusion"
from .diagnostics import FusedGroup, PassRecord, Rejection
from .explain import FusionReport, explain
from .fused_kv_pass import FusedKVPass

__all__ = [
    "FusedGroup",
    "FusedKVPass",
    "FusionReport",
    "PassRecord",
    "Rejection",
    "explain",
    "fused_norm_rope_stacked",
    "fx_fusion_backend",
]
