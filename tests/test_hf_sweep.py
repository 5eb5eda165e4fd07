"""The architecture sweep: every causal LM the installed transformers registers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, discovered, never listed by hand) generates
eager's tokens through ``attn_implementation="clattn"`` or is refused by name.

Each model type is built tiny from its config class (tests/hf_sweep.py: hidden size 64,
2 layers, a 128-token vocabulary, windows and chunks of 8) and generates 6 tokens
greedily for a left-padded batch of two prompts of 14 and 10 tokens, on the cpu backend
and on one OpenCL device. The outcome must be the expected one: a refusal
(``UnsupportedFeatureError``) whose message names the reason of :data:`hf_sweep.REFUSED`,
eager's tokens for every other type, never a crash, a layer that skipped clattn or an
eager attention call. A type that a later transformers adds is swept as it comes, and
fails until it runs exact or is given a reason. docs/transformers.md shows the same table.
"""
from __future__ import annotations

import re
from pathlib import Path

import hf_sweep
import pytest
import torch
from conftest import DEVICES

TYPES = hf_sweep.causal_lm_types()
DOCS = Path(__file__).resolve().parent.parent / "docs" / "transformers.md"
torch.set_num_threads(1)  # tiny models: see tests/test_hf_refusals.py


def expect(model_type: str, outcome: tuple[str, str]) -> None:
    status, message = outcome
    if model_type in hf_sweep.REFUSED:
        pattern = hf_sweep.REASONS[hf_sweep.REFUSED[model_type]][0]
        assert status == "refused" and re.search(pattern, message), \
            f"{model_type}: expected a refusal matching {pattern!r}, got {outcome}"
    elif model_type in hf_sweep.NOT_BUILT:
        assert status == "not built", f"{model_type} builds now: {outcome}; sweep it " \
                                      f"(remove it from hf_sweep.NOT_BUILT)"
    else:
        assert status == "exact", f"{model_type}: {outcome}"


SWEPT = [t for t in TYPES if hf_sweep.wrapped_text_type(t) is None]


@pytest.mark.parametrize("model_type", SWEPT)
def test_every_causal_lm_runs_exact_or_is_refused_by_name_on_the_cpu_backend(model_type):
    expect(model_type, hf_sweep.run(model_type, backend="cpu"))


OPENCL = list(DEVICES.items())[:1]  # one OpenCL device: the first present and selected


@pytest.mark.skipif(not OPENCL, reason="no OpenCL device present or selected")
@pytest.mark.parametrize("model_type", [t for t in SWEPT if t not in hf_sweep.REFUSED and
                                        t not in hf_sweep.NOT_BUILT])
def test_every_causal_lm_that_runs_is_exact_on_an_opencl_device(model_type):
    expect(model_type, hf_sweep.run(model_type, device=OPENCL[0][1], backend="opencl"))


def test_multimodal_wrappers_are_swept_through_their_text_model():
    """A causal LM whose config wraps a ``text_config`` is its text model's type."""
    for t in TYPES:
        text = hf_sweep.wrapped_text_type(t)
        assert text is None or text in TYPES or t in hf_sweep.NOT_BUILT, \
            f"{t} wraps {text}, which is not swept"


def test_the_tables_name_only_what_this_transformers_registers_or_reasons_it_has():
    assert set(hf_sweep.REFUSED.values()) <= set(hf_sweep.REASONS)
    assert not set(hf_sweep.REFUSED) & set(hf_sweep.NOT_BUILT)


def test_the_docs_show_the_sweeps_refusal_table():
    text = DOCS.read_text()
    start, end = "<!-- sweep-refusals -->", "<!-- /sweep-refusals -->"
    assert start in text and end in text, f"docs/transformers.md lacks {start}"
    shown = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert shown == hf_sweep.refusal_table(), \
        "docs/transformers.md's refusal table is not tests/hf_sweep.py's: paste " \
        "hf_sweep.refusal_table() between the markers"
