"""The error the transformers integration raises for what clattn cannot compute (its own
module, so that every part of the integration can raise it; ``hf_cache`` and
``transformers`` export it)."""
from __future__ import annotations

__all__ = ["UnsupportedFeatureError"]


class UnsupportedFeatureError(NotImplementedError):
    """A model or call feature clattn cannot compute; the message names it."""
