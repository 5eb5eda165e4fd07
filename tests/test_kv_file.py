"""Sequences saved to a KV file and loaded back (issue 39): bit-exact round trips on every
backend and across them, and every bad file refused with the cache unchanged.

One scenario per page format (f16, f32, q8_0 keys with q4_0 values, f16 values of
another width than the keys, f32 values read from the key rows) on the CPU backend
and each device (its own profile): a sequence without a window, one with a window of 6
and 2 sinks that has slid (pages given back) and stands mid-way through its window at
the save, with a position offset, and a fork sharing the first sequence's pages, its
partly filled last page included; RoPE in the kernel. The file is loaded into a second
cache that already holds another sequence (so other pool pages are taken); then both
caches run the same steps (a decode step whose forks copy their shared page, a prompt
chunk) and must give the same bits: pools, lengths, outputs and LSEs. Every token
attends on the decode kernel (``prefill=False``: fewer kernel builds; which kernel reads
the pages does not touch what a file holds). The files of every
backend load on every other and give that backend's own results, since the pages' bytes
do not depend on the device (docs/cache.md, "Quantized pages").
"""
from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
from conftest import DEVICES, Target, _selected

import clattn
from clattn import kv_file
from clattn.cache_store import read_header
from clattn.cache_tables import DuplicateSequenceError
from clattn.kv_file import KVFileCorruptError, KVFileError, KVFileMismatchError, KVFileVersionError

LAYERS = 2
FORMATS = {"f16": dict(dtype="float16"), "f32": dict(dtype="float32"),
           "q8_0-q4_0": dict(dtype="float16", k_format="q8_0", v_format="q4_0"),
           "f16-v16": dict(dtype="float16", head_dim_v=16),  # values of their own width
           "f32-latent": dict(dtype="float32", head_dim_v=16, value_in_key=True)}  # in K rows
TARGETS = ([Target("cpu")] if _selected("cpu") else []) + \
    [Target(k, d) for k, d in DEVICES.items()]
IDS = ("a", "w", "f")


def spec_of(fmt: str, **kw) -> clattn.AttentionSpec:
    shape = dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                 sliding_window=True)
    return clattn.AttentionSpec(**{**shape, **FORMATS[fmt], **kw})


def make(spec, target, num_pages=48, **kw) -> clattn.PagedKVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if target.is_cpu:
            return clattn.PagedKVCache(spec, LAYERS, backend="cpu", num_pages=num_pages,
                                       rope="attend", **kw)
        return clattn.PagedKVCache(spec, LAYERS, device=target.device, backend="opencl",
                                   num_pages=num_pages, rope="attend", prefill=False, **kw)


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def step(cache, ids, lengths, seed) -> list:
    """One step of random k, v, q; the outputs and LSEs of each layer, as bytes."""
    r = np.random.default_rng(seed)
    T, dt = sum(lengths), cache.spec.np_dtype
    cache.begin(list(ids), list(lengths))
    got = []
    for layer in range(LAYERS):
        k = r.standard_normal((T, 2, cache.spec.head_dim)).astype(dt)
        v = r.standard_normal((T, 2, cache.spec.head_dim_v)).astype(dt)
        q = r.standard_normal((T, 4, cache.spec.head_dim)).astype(dt)
        cache.append(layer, k, None if cache.spec.value_in_key else v)
        res = cache.attend(layer, q)
        got.append((host(res.out).tobytes(), host(res.lse).tobytes()))
    cache.end()
    return got


def seq_pages(cache, sid) -> list[bytes]:
    """The bytes of each page the sequence holds, every layer."""
    pages = cache.table.state(sid).pages
    return [host(cache.pools[layer])[pages].tobytes() for layer in range(LAYERS)]


def sharing(cache, ids) -> list:
    """Which (sequence, page) pairs hold the same pool page: the fork structure."""
    lists = [cache.table.state(i).pages.tolist() for i in ids]
    flat = [p for pl in lists for p in pl]
    return [[flat.index(p) for p in pl] for pl in lists]


def build(spec, target):
    """The scenario's cache at the save."""
    c = make(spec, target)
    c.add("a")
    c.add("w", window=6, sink=2, pos_offset=3)
    step(c, ["a", "w"], [7, 9], 1)  # a: 7 rows, its last page partly filled
    c.fork("a", "f")
    step(c, ["w"], [5], 2)  # w slides on: pages between sinks and window go back
    step(c, ["w"], [1], 3)
    return c


def continuation(c) -> list:
    return step(c, list(IDS), [1, 1, 1], 4) + step(c, ["f", "w"], [5, 3], 5)


_SCENARIOS: dict = {}


def scenario(fmt, target, tmp_path_factory):
    """(file, the pages of each sequence at the save, the continuation's results) of the
    scenario on ``target``, made once."""
    key = (fmt, target.name)
    if key not in _SCENARIOS:
        c = build(spec_of(fmt), target)
        assert c.table.state("w").dropped > 0, "the window has not given pages back"
        assert 0 < c.length("w") - c.table.state("w").dropped * 4
        path = tmp_path_factory.mktemp("kv") / f"{fmt}-{target.name}.clkv"
        c.save(path)
        pages = {i: seq_pages(c, i) for i in IDS}
        state = {i: c.table.state(i) for i in IDS}
        _SCENARIOS[key] = (path, pages, state, sharing(c, IDS), continuation(c))
    return _SCENARIOS[key]


def loaded(fmt, target, path):
    """A cache holding another sequence ("x", one page partly filled) that loads ``path``."""
    c = make(spec_of(fmt), target)
    c.add("x")
    step(c, ["x"], [6], 9)
    before = seq_pages(c, "x")
    assert c.load(path) == IDS
    assert seq_pages(c, "x") == before
    return c


def check_same(c, pages, state, shared):
    for i in IDS:
        got = c.table.state(i)
        assert (got.length, got.dropped, got.window, got.sink, got.pos_offset) == \
            (state[i].length, state[i].dropped, state[i].window, state[i].sink,
             state[i].pos_offset)
        assert seq_pages(c, i) == pages[i], f"{i}: the pages' bytes differ"
    assert sharing(c, IDS) == shared


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_round_trip_bit_exact(fmt, target, tmp_path_factory):
    path, pages, state, shared, results = scenario(fmt, target, tmp_path_factory)
    c = loaded(fmt, target, path)
    check_same(c, pages, state, shared)
    assert c.stats().pages_shared == 2  # a and f share both their pages, written once
    assert read_header(path)["num_pages"] == \
        len({p for i in IDS for p in c.table.state(i).pages.tolist()})
    assert continuation(c) == results
    c.remove("x")
    for i in IDS:
        c.remove(i)
    assert c.stats().pages_free == c.num_pages


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_across_backends(fmt, tmp_path_factory):
    """Each backend's file on every other: the same page bytes, the loading backend's own
    results."""
    if len(TARGETS) < 2:
        pytest.skip("one backend selected")
    runs = {t.name: scenario(fmt, t, tmp_path_factory) for t in TARGETS}
    for src in TARGETS:
        for dst in TARGETS:
            if src.name == dst.name:
                continue
            _, pages, state, shared, results = runs[dst.name]
            c = loaded(fmt, dst, runs[src.name][0])
            check_same(c, pages, state, shared)
            assert continuation(c) == results, f"{src} -> {dst}"


def test_offload_restore_new_ids(tmp_path):
    if not TARGETS:
        pytest.skip("no backend selected (CLATTN_TEST_DEVICES)")
    target = TARGETS[0]
    c = build(spec_of("f16"), target)
    ref = make(spec_of("f16"), target)
    path = tmp_path / "chat.clkv"
    pages = seq_pages(c, "w")
    free = c.stats().pages_free
    c.offload(path, ["w"])
    assert "w" not in c and c.stats().pages_free > free
    assert c.restore(path, new_ids=["w2"]) == ("w2",)
    assert seq_pages(c, "w2") == pages and c.stats().pages_free == free
    assert ref.load(path, new_ids=[("chat", 7)]) == (("chat", 7),)
    assert step(c, ["w2"], [2], 6) == step(ref, [("chat", 7)], [2], 6)


# -- bad files --------------------------------------------------------------------------
def snapshot(c) -> tuple:
    t = c.table
    seqs = {i: (s.length, s.dropped, s.window, s.sink, s.pos_offset,
                s.pages[:s.npages].tobytes()) for i, s in t.seqs.items()}
    return ([host(p).tobytes() for p in c.pools], t.refcount.tobytes(), list(t.free), seqs)


@pytest.fixture(params=TARGETS, ids=str)
def bad_setup(request, tmp_path_factory):
    """(target, the scenario's f16 file, a cache holding "a" and "x" to refuse it into)."""
    target = request.param
    path = scenario("f16", target, tmp_path_factory)[0]
    c = make(spec_of("f16"), target)
    c.add("a")
    step(c, ["a"], [5], 7)
    c.add("x")
    step(c, ["x"], [3], 8)
    return target, path, c


def refused(c, path, exc, match=None, **kw):
    before = snapshot(c)
    with pytest.raises(exc, match=match):
        c.load(path, **kw)
    assert snapshot(c) == before, "a refused load changed the cache"


def test_refused_bad_bytes(bad_setup, tmp_path):
    target, path, c = bad_setup
    data = path.read_bytes()
    bad = tmp_path / "bad.clkv"
    for n in sorted({0, 1, 7, 8, 15, 16, 17, 100, len(data) // 2, len(data) - 17,
                     len(data) - 16, len(data) - 1}):
        bad.write_bytes(data[:n])
        refused(c, bad, KVFileCorruptError)
    bad.write_bytes(data + b"\0")
    refused(c, bad, KVFileCorruptError)
    # every byte of the prefix, header, padding and trailer, and of each layer its first,
    # last and every 61st byte: each region is under one CRC-32, which finds any change
    # of one byte (a burst of <= 32 bits) wherever it lies
    start = kv_file.data_offset(struct.unpack_from("<I", data, 12)[0])
    lb = read_header(path)["layer_bytes"]
    where = set(range(start)) | set(range(len(data) - 16, len(data)))
    for layer in range(LAYERS):
        lo = start + layer * lb
        where |= {lo, lo + lb - 1} | set(range(lo, lo + lb, 61))
    if not target.is_cpu:  # host code alike on every backend: a sample on the devices
        where = set(sorted(where)[::7])
    bad.write_bytes(data)
    before = snapshot(c)
    with open(bad, "r+b") as f:
        for i in sorted(where):
            f.seek(i)
            f.write(bytes([data[i] ^ 0x5A]))
            f.flush()
            with pytest.raises(KVFileError) as info:
                c.load(bad)
            if not 8 <= i < 12:  # the version field: a newer version, or none
                assert isinstance(info.value, KVFileCorruptError), (i, info.value)
            f.seek(i)
            f.write(data[i:i + 1])
    assert bad.read_bytes() == data
    assert snapshot(c) == before


def test_refused_newer_version(bad_setup, tmp_path):
    _, path, c = bad_setup
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", kv_file.FORMAT_VERSION + 1)
    bad = tmp_path / "new.clkv"
    bad.write_bytes(data)
    refused(c, bad, KVFileVersionError, match="newer")


def test_refused_other_cache(bad_setup, tmp_path_factory):
    target, path, c = bad_setup
    qpath = scenario("q8_0-q4_0", target, tmp_path_factory)[0]
    refused(c, qpath, KVFileMismatchError, match="page format")
    for other in (make(spec_of("f16", num_qo_heads=2), target),
                  make(spec_of("f16"), target, rope_theta=5e5)):
        other.add("y")
        refused(other, path, KVFileMismatchError)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kw = dict(backend="cpu") if target.is_cpu else dict(device=target.device,
                                                            backend="opencl")
        for layers, rope in ((LAYERS + 1, "attend"), (LAYERS, None)):
            other = clattn.PagedKVCache(spec_of("f16"), layers, num_pages=48, rope=rope, **kw)
            refused(other, path, KVFileMismatchError)


def test_refused_ids_and_budget(bad_setup):
    target, path, c = bad_setup
    refused(c, path, DuplicateSequenceError, match="'a'")
    refused(c, path, DuplicateSequenceError, new_ids=["b", "b", "c"])
    refused(c, path, ValueError, new_ids=["b"])
    need = read_header(path)["num_pages"]
    small = make(spec_of("f16"), target, num_pages=need + 1)
    small.add("x")
    step(small, ["x"], [5], 3)  # two pages held: one too few left
    refused(small, path, clattn.CacheFullError, match="load")
    small.remove("x")
    assert small.load(path) == IDS and small.stats().pages_free == 1


def test_refused_sound_file_with_inconsistent_sequences(bad_setup, tmp_path):
    """A file whose CRCs hold but whose page lists or window settings cannot be a
    cache's (another program wrote it) is refused as corrupt."""
    _, path, c = bad_setup
    with kv_file.open_verified(path) as f:
        header = dict(f.header)
        layers = [np.array(f.layer(i)) for i in range(LAYERS)]
    for key, value in (("pages", [99]), ("pages", []), ("sink", -1), ("dropped", 2),
                       ("window", 0)):
        seqs = [dict(s) for s in header["sequences"]]
        seqs[0][key] = value  # sequence "a": no window
        bad = tmp_path / f"{key}.clkv"
        kv_file.write(bad, dict(header, sequences=seqs), layers, num_layers=LAYERS,
                      layer_bytes=header["layer_bytes"])
        refused(c, bad, KVFileCorruptError, match="inconsistent")


def test_load_takes_one_run_of_free_pages_when_there_is_one():
    """The pages a load takes: the lowest run of consecutive free pages long enough (one
    transfer per layer), else the lowest free pages; the free list keeps the rest."""
    from clattn.cache_tables import PageTable, SeqState
    t = PageTable(spec_of("f16"), 12)
    for i in range(12):  # one page each
        t.add(i, window=None, sink=0, pos_offset=0)
        t.reserve([i], [4], None)
    for i in (1, 3, 4, 6, 7, 8, 10):
        t.remove(i)
    st = SeqState(length=12, dropped=0, window=None, sink=0, pos_offset=0,
                  pages=np.arange(3))
    assert t.install([("a", st)], 3).tolist() == [6, 7, 8]
    assert t.install([("b", st)], 3).tolist() == [1, 3, 4]
    assert t.free == [10] and t.refcount.tolist() == [int(p != 10) for p in range(12)]


def test_interrupted_save_leaves_the_old_file(tmp_path):
    """A save stopped part-way (here: Ctrl-C while the second layer is read back) leaves
    the file as it was and no temporary file."""
    path = tmp_path / "chat.clkv"
    path.write_bytes(b"the old file")

    def layers():
        yield np.zeros(8, np.uint8)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kv_file.write(path, {"sequences": []}, layers(), num_layers=2, layer_bytes=8)
    assert path.read_bytes() == b"the old file"
    assert [p.name for p in tmp_path.iterdir()] == ["chat.clkv"]
