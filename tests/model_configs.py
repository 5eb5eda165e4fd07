"""Real model attention configs (a compact fixture of shared/models/models.json).

Records are raw: the keys of each model's HF ``config.json`` (flattened from ``text_config``
for multimodal ones), nothing completed. How a record is read is ``hf_oracle.read_config``'s
business (the tests' own reading of transformers), never clattn's.
"""
from __future__ import annotations

import copy
import json
import os
from functools import lru_cache

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "models.json")


@lru_cache(maxsize=1)
def _load():
    with open(_PATH, encoding="utf-8") as f:
        return json.load(f)["models"]


def load_models() -> list[dict]:
    """Every model record (fresh copies: callers may mutate them)."""
    return copy.deepcopy(_load())


def model_names() -> list[str]:
    return [m["name"] for m in _load()]


def model(name: str) -> dict:
    """One model record by exact name (a fresh copy)."""
    for m in _load():
        if m["name"] == name:
            return copy.deepcopy(m)
    raise KeyError(f"no model named {name!r} in {_PATH}")
