"""Real model attention configs (a compact fixture of shared/models/models.json)."""
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


def model(name: str) -> dict:
    """One model record by exact name (a fresh copy)."""
    for m in _load():
        if m["name"] == name:
            return copy.deepcopy(m)
    raise KeyError(f"no model named {name!r} in {_PATH}")


def sm_scale_of(m: dict) -> float | None:
    """The softmax scale a model uses: query_pre_attn_scalar ** -0.5 when given, else None (1/sqrt(D))."""
    qs = m.get("query_pre_attn_scalar")
    return None if qs is None else float(qs) ** -0.5


def rope_scaling_of(m: dict) -> dict | None:
    """The model's rope_scaling dict, completed the way clattn's spec does it:
    GPT-J gets ``{"rope_type": "gptj"}``; a top-level original_max_position_embeddings is copied in."""
    rs = copy.deepcopy(m.get("rope_scaling"))
    if m.get("model_type") == "gptj" and not rs:
        rs = {"rope_type": "gptj"}
    if rs is not None and "original_max_position_embeddings" not in rs and \
            m.get("original_max_position_embeddings"):
        rs["original_max_position_embeddings"] = m["original_max_position_embeddings"]
    return rs


def rotary_dim_of(m: dict) -> int | None:
    """rotary_dim from ``rotary_dim`` or ``partial_rotary_factor`` (None means head_dim)."""
    if m.get("rotary_dim") is not None:
        return int(m["rotary_dim"])
    if m.get("partial_rotary_factor") is not None:
        return int(m["head_dim"] * float(m["partial_rotary_factor"]))
    return None
