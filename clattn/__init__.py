"""clattn: OpenCL decode attention over a paged KV cache, for on-device LLM inference.

Public names only; see README.md for the semantics (base-2 LSE, exact empty states).
"""
from .cache import CacheFullError, PagedKVCache
from .decode import BatchDecode
from .mask import pack_mask, tree_mask
from .merge import merge_state, merge_state_, merge_states
from .plan import Plan
from .prefill import BatchPrefill, PrefillPlan
from .profiles.record import Profile
from .result import AttentionResult, DecodeResult
from .runtime import BuildError, DeviceUnusableError, NoDeviceError, ensure_icd, select_device
from .spec import AttentionSpec

ensure_icd()

__all__ = ["AttentionResult", "AttentionSpec", "BatchDecode", "BatchPrefill", "BuildError",
           "CacheFullError", "DecodeResult", "DeviceUnusableError", "NoDeviceError",
           "PagedKVCache", "Plan", "PrefillPlan", "Profile", "merge_state", "merge_state_",
           "merge_states", "pack_mask", "select_device", "tree_mask"]
__version__ = "0.1.0"
