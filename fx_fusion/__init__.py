"""fx-fusion: a torch.compile pass that fuses multi-layer draft K/V materialization."""

import os as _os

# The Triton kernels and custom ops live in the repository's top-level kernels/ directory, which the
# build installs as the subpackage fx_fusion.kernels (pyproject.toml). In a source checkout or an editable
# install that directory sits beside this package, so let the subpackage be found there too.
_source_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_source_root, "kernels")) and not _os.path.isdir(
    _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "kernels")
):
    __path__.append(_source_root)  # noqa: F821 - package __path__

from fx_fusion.kernels.ops import fused_norm_rope_stacked  # noqa: E402

from .backend import fx_fusion_backend  # noqa: E402  (registers backend="fx_fusion")
from .diagnostics import FusedGroup, PassRecord, Rejection  # noqa: E402
from .explain import FusionReport, explain  # noqa: E402
from .fused_kv_pass import FusedKVPass  # noqa: E402

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
