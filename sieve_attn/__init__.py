"""sieve-attn: sparse attention for pretrained and new transformers (Focus token-pair and SFA feature sparsity)."""
from ._checks import skip_nan_checks
from .config import FocusConfig, SFAConfig
from .integrations.transformers import compose, load_adapter, reconfigure, save_adapter, set_focus_mode
from .nn.router import FocusRouter
from .ops.focus.attention import focus_attention, focus_backend, focus_soft_attention
from .ops.focus.groups import FocusGroups
from .ops.sfa.attention import sfa_attention, sfa_backend
from .ops.sfa.cache import SFAKeyCache, dense_bytes_per_token
from .ops.sfa.codes import sparse_codes
from .ops.sfa.decode import sfa_decode
from .train.calibrate import calibrate_feature_maps

__version__ = "0.1.0"


def __getattr__(name: str):
    # SFACache subclasses transformers' Cache: imported on first use, so that `import sieve_attn` stays light.
    if name == "SFACache":
        from .integrations.sfa_cache import SFACache
        return SFACache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FocusConfig", "FocusGroups", "FocusRouter", "SFACache", "SFAConfig", "SFAKeyCache",
           "calibrate_feature_maps", "compose", "dense_bytes_per_token", "focus_attention", "focus_backend",
           "focus_soft_attention", "load_adapter", "reconfigure", "save_adapter", "set_focus_mode", "sfa_attention",
           "sfa_backend", "sfa_decode", "skip_nan_checks", "sparse_codes"]
