"""``clattn render KIND`` prints the OpenCL C of every kernel template: each kind, with rows
and tiled kernels, every page format for the append, without a device (generic limits)."""
from __future__ import annotations

from pathlib import Path

import pytest

from clattn import AttentionSpec, cli, codegen
from clattn.profiles import STRATEGIES
from clattn.quant import KV_FORMATS

#: (kind, strategy) -> the template it renders and the kernel its source must hold
TEMPLATES = {
    ("decode", "rows"): ("decode_rows", "clattn_decode"),
    ("decode", "tiled"): ("decode_tiled", "clattn_decode"),
    ("prefill", "rows"): ("prefill_rows", "clattn_prefill"),
    ("prefill", "tiled"): ("prefill_tiled", "clattn_prefill"),
    **{(k, s): ("merge", "clattn_merge_pair") for k in ("merge", "split-merge")
       for s in STRATEGIES},
    **{("append", s): ("append", "clattn_append") for s in STRATEGIES},
    **{("half-probe", s): ("half_probe", "clattn_half_probe") for s in STRATEGIES},
}


def _render(capsys, *argv: str) -> tuple[list[str], str]:
    assert cli.main(["render", *argv, "--device", "none"]) == 0
    out = capsys.readouterr().out
    head = [line[3:] for line in out.splitlines() if line.startswith("// ")]
    return head, out


def test_every_template_has_a_kind():
    on_disk = {p.name[:-len(".cl.mako")] for p in Path(codegen.KERNELS_DIR).glob("*.cl.mako")}
    assert {t for t, _ in TEMPLATES.values()} == on_disk
    assert {k for k, _ in TEMPLATES} == set(cli.RENDER_KINDS)


@pytest.mark.parametrize("kind,strategy", sorted(TEMPLATES))
def test_render_kind(capsys, kind, strategy):
    template, kernel = TEMPLATES[kind, strategy]
    head, out = _render(capsys, kind, "--strategy", strategy, "--heads", "14",
                        "--kv-heads", "2", "--head-dim", "64")
    assert head[0].startswith(f"clattn {kind} kernel for AttentionSpec(num_qo_heads=14")
    assert f"strategy {strategy}" in head[2]
    geometry = [h for h in head if h.startswith("geometry: ")]
    assert len(geometry) == 1
    if kind != "half-probe":
        assert f"strategy='{strategy}'" in geometry[0]
    assert f"{kernel}(" in out
    assert "${" not in out  # every template expression substituted


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_render_append_each_page_format(capsys, fmt):
    _, out = _render(capsys, "append", "--k-format", fmt, "--v-format", fmt)
    assert f"k_format='{fmt}', v_format='{fmt}'" in out
    byte_pool = AttentionSpec(32, 8, 128, k_format=fmt, v_format=fmt).byte_pool
    assert ("clattn_append_check" in out) == byte_pool  # a byte pool checks its rows


def test_render_split_merge_reads_f32_states(capsys):
    _, split = _render(capsys, "split-merge", "--strategy", "tiled")
    _, merge = _render(capsys, "merge", "--strategy", "tiled")
    assert split != merge  # f32 partial states in, f16 out; merge_state keeps f16


def test_render_unknown_kind_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["render", "attention"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("kind,strategy", sorted(k for k in TEMPLATES if k[0] != "half-probe"))
def test_render_values_of_another_width(capsys, kind, strategy):
    """--head-dim-v: DeepSeek-V2-Lite's decompressed heads (q/k 192, v 128); the merges
    take states as wide as the values."""
    head, out = _render(capsys, kind, "--strategy", strategy, "--heads", "16",
                        "--kv-heads", "16", "--head-dim", "192", "--head-dim-v", "128")
    assert "head_dim=192" in head[0] and "head_dim_v=128" in head[0]
    assert "${" not in out
    if kind in ("decode", "prefill"):
        assert "* 128" in out and "* 192" in out   # out rows 128 wide, q rows 192


@pytest.mark.parametrize("kind,strategy", [("decode", "rows"), ("decode", "tiled"),
                                           ("prefill", "rows"), ("append", "rows")])
def test_render_values_in_the_key_rows(capsys, kind, strategy):
    """--value-in-key: DeepSeek-V2-Lite's absorbed form (one 576-wide row, values its first
    512); the page holds key regions only, so no address goes past them."""
    head, out = _render(capsys, kind, "--strategy", strategy, "--heads", "16",
                        "--kv-heads", "1", "--head-dim", "576", "--head-dim-v", "512",
                        "--value-in-key")
    assert "value_in_key=True" in head[0] and "head_dim_v=512" in head[0]
    assert "${" not in out
    assert f"* {16 * 576 * 2}" in out   # a page's bytes: one K region
    if kind == "append":
        assert "n_copies * 16;" in out   # copies of (K region, row) only: 1 head x 16 rows
