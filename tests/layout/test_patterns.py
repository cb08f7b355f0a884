"""Every pattern against an element-level definition written here independently of layout/patterns/:
build the element mask by broadcasting over (q, k) positions and compare the layout's element mask
with it exactly (element-exact layouts), and its kept blocks with the blocks holding an allowed
element."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_io_attn import BlockSparseLayout, patterns

# (seqlen, block_size): square and rectangular blocks, lengths not a multiple of the block, Nq != Nk
SHAPES = [
    pytest.param(64, 16, id="N64-b16"),
    pytest.param(100, 16, id="N100-b16-ragged"),
    pytest.param((70, 45), (16, 8), id="Nq70-Nk45-b16x8"),
    pytest.param((33, 97), (8, 32), id="Nq33-Nk97-b8x32"),
    pytest.param((5, 130), 32, id="Nq5-Nk130-b32"),
]


def qk(seqlen):
    sq, sk = (seqlen, seqlen) if isinstance(seqlen, int) else seqlen
    return torch.arange(sq)[:, None], torch.arange(sk)[None, :]


# ---- element-level definitions (the specification, written without looking at the block logic)
def elem_window(q, k, window, causal):
    d = q - k
    return ((d >= 0) & (d <= window)) if causal else (d.abs() <= window)


def elem_strided(q, k, stride, causal):
    d = q - k
    elem = (d.abs() < stride) | (torch.remainder(d, stride) == 0)
    return elem & (d >= 0) if causal else elem


def elem_fixed(q, k, stride, summary, causal):
    elem = (q // stride == k // stride) | (k % stride >= stride - summary)
    return elem & (k <= q) if causal else elem


def elem_document(cu, causal):
    doc = torch.empty(cu[-1], dtype=torch.int64)
    for i in range(len(cu) - 1):
        doc[cu[i]:cu[i + 1]] = i
    q, k = qk(cu[-1])
    elem = doc[q] == doc[k]
    return elem & (k <= q) if causal else elem


def blocks_of(elem: torch.Tensor, block_size) -> torch.Tensor:
    """Blocks holding at least one allowed element."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    sq, sk = elem.shape
    pad = torch.zeros(-(-sq // bq) * bq, -(-sk // bk) * bk, dtype=torch.bool)
    pad[:sq, :sk] = elem
    return pad.view(pad.shape[0] // bq, bq, pad.shape[1] // bk, bk).any(3).any(1)


def check(layout, elem, block_size):
    assert layout.seqlen == tuple(elem.shape) and layout.num_layouts == 1
    got = layout.to_dense_mask()[0, 0]
    assert torch.equal(got, elem), f"{layout.name}: {int((got != elem).sum())} elements differ"
    expect = blocks_of(elem, block_size)
    blocks = layout.to_block_mask()[0, 0]
    assert torch.equal(blocks, expect), f"{layout.name}: {int((blocks != expect).sum())} blocks differ"


@pytest.mark.parametrize("seqlen,block", SHAPES)
def test_dense_and_causal(seqlen, block):
    q, k = qk(seqlen)
    check(patterns.dense(seqlen, block), (q >= 0) & (k >= 0), block)
    check(patterns.causal(seqlen, block), k <= q, block)
    check(patterns.dense(seqlen, block, causal=True), k <= q, block)


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("window", [0, 1, 7, 16, 40])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sliding_window(seqlen, block, window, causal):
    q, k = qk(seqlen)
    lo = patterns.sliding_window(seqlen, block, window, causal=causal)
    check(lo, elem_window(q, k, window, causal), block)
    assert lo.name == f"sliding_window(w={window}{',causal' if causal else ''})"


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("stride", [1, 5, 24, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided(seqlen, block, stride, causal):
    q, k = qk(seqlen)
    check(patterns.strided(seqlen, block, stride, causal=causal), elem_strided(q, k, stride, causal), block)


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("stride,summary", [(1, 1), (12, 1), (12, 5), (32, 8), (40, 40)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fixed(seqlen, block, stride, summary, causal):
    q, k = qk(seqlen)
    lo = patterns.fixed(seqlen, block, stride, summary, causal=causal)
    check(lo, elem_fixed(q, k, stride, summary, causal), block)
    assert lo.name.startswith(f"fixed(stride={stride},c={summary}")


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("window,glob", [(0, 1), (9, 3), (20, [4, 50, 3]), (3, 0), (3, [])])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longformer(seqlen, block, window, glob, causal):
    q, k = qk(seqlen)
    n = max(q.shape[0], k.shape[1])
    positions = list(range(glob)) if isinstance(glob, int) else glob
    is_global = torch.zeros(n + 1, dtype=torch.bool)
    is_global[[p for p in positions if p < n]] = True
    elem = elem_window(q, k, window, causal) | is_global[q] | is_global[k]
    if causal:
        elem &= k <= q
    check(patterns.longformer(seqlen, block, window, glob, causal=causal), elem, block)


@pytest.mark.parametrize("cu", [[0, 64], [0, 10, 40, 41, 100], [0, 17, 17, 60, 128], [0, 1, 2, 3, 5]])
@pytest.mark.parametrize("block", [16, (8, 32), 1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_document(cu, block, causal):
    elem = elem_document(cu, causal)
    check(patterns.document(cu, block, causal=causal), elem, block)
    check(patterns.block_diagonal(torch.tensor(cu, dtype=torch.int32), block, causal=causal), elem, block)


def bigbird_fixed_part(seqlen, block, window, num_global, causal):
    """Element definition of BigBird's deterministic part: band, global query/key blocks."""
    bq, bk = (block, block) if isinstance(block, int) else block
    q, k = qk(seqlen)
    elem = elem_window(q, k, window, causal) | (q < num_global * bq) | (k < num_global * bk)
    if causal:
        elem &= k <= q
    allowed = blocks_of((k <= q) if causal else (q >= k) | (q < k), block)
    return blocks_of(elem, block), allowed


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bigbird(seqlen, block, causal):
    window, g, r, heads = 10, 1, 2, 3
    lo = patterns.bigbird(seqlen, block, window=window, num_global=g, num_random=r, seed=5,
                          num_heads=heads, causal=causal)
    fixed_part, allowed = bigbird_fixed_part(seqlen, block, window, g, causal)
    m = lo.to_block_mask()[0]
    assert lo.layout_batch == 1 and lo.layout_heads == heads
    assert lo.name == f"bigbird(w={window},g={g},r={r},seed=5{',causal' if causal else ''})"
    candidates = allowed & ~fixed_part
    for h in range(heads):
        assert torch.equal(m[h] & fixed_part, fixed_part)  # deterministic part kept
        extra = m[h] & ~fixed_part
        assert not (extra & ~allowed).any()  # random blocks only where allowed
        expect = torch.clamp(candidates.sum(1), max=r)  # exactly r random blocks per row when possible
        assert torch.equal(extra.sum(1), expect)
    again = patterns.bigbird(seqlen, block, window=window, num_global=g, num_random=r, seed=5,
                             num_heads=heads, causal=causal)
    assert again.equal(lo)


def test_bigbird_heads_and_seeds_differ():
    kw = dict(window=16, num_global=1, num_random=3)
    a = patterns.bigbird(1024, 32, num_heads=4, seed=0, **kw).to_block_mask()[0]
    b = patterns.bigbird(1024, 32, num_heads=4, seed=1, **kw).to_block_mask()[0]
    assert all(not torch.equal(a[0], a[h]) for h in range(1, 4))
    assert not torch.equal(a, b)
    one = patterns.bigbird(1024, 32, seed=0, **kw)
    assert one.layout_heads == 1 and torch.equal(one.to_block_mask()[0, 0], a[0])


@pytest.mark.parametrize("seqlen,block", SHAPES)
@pytest.mark.parametrize("density", [0.0, 0.13, 0.5, 1.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_exact_count(seqlen, block, density, causal):
    q, k = qk(seqlen)
    allowed = blocks_of((k <= q) if causal else (q >= k) | (q < k), block)
    lo = patterns.random(seqlen, block, density, seed=3, num_heads=2, causal=causal)
    m = lo.to_block_mask()[0]
    n = int(allowed.sum())
    assert torch.equal(m.sum((1, 2)), torch.full((2,), round(density * n)))
    assert not (m & ~allowed).any()
    assert patterns.random(seqlen, block, density, seed=3, num_heads=2, causal=causal).equal(lo)


def test_random_heads_and_seeds_differ():
    a = patterns.random(2048, 64, 0.2, seed=0, num_heads=4).to_block_mask()[0]
    b = patterns.random(2048, 64, 0.2, seed=1, num_heads=4).to_block_mask()[0]
    assert all(not torch.equal(a[0], a[h]) for h in range(1, 4)) and not torch.equal(a, b)
    assert a.sum().item() == 4 * round(0.2 * 32 * 32)


# ------------------------------------------------------------------------------ specs
@pytest.mark.parametrize("spec,expect", [
    ("dense", patterns.dense(4096, 64)),
    ("causal", patterns.causal(4096, 64)),
    ("sliding_window:512", patterns.sliding_window(4096, 64, 512)),
    ("sliding_window:w=192,causal", patterns.sliding_window(4096, 64, 192, causal=True)),
    ("window:100,causal=true", patterns.sliding_window(4096, 64, 100, causal=True)),
    ("bigbird:window=256,global=1,random=2", patterns.bigbird(4096, 64, window=256, num_global=1,
                                                              num_random=2)),
    ("bigbird:64,1,2,seed=7", patterns.bigbird(4096, 64, window=64, num_global=1, num_random=2, seed=7)),
    ("longformer:128,global=0/700", patterns.longformer(4096, 64, 128, [0, 700])),
    ("strided:256", patterns.strided(4096, 64, 256)),
    ("fixed:256,c=32", patterns.fixed(4096, 64, 256, 32)),
    ("random:0.25,seed=2", patterns.random(4096, 64, 0.25, seed=2)),
    ("document:4", patterns.document([0, 1024, 2048, 3072, 4096], 64)),
    ("document:lengths=1000/3096,causal", patterns.document([0, 1000, 4096], 64, causal=True)),
    ("block_diagonal:cu_seqlens=0/96/4096", patterns.document([0, 96, 4096], 64)),
])
def test_from_spec(spec, expect):
    got = patterns.from_spec(spec, seqlen=4096, block_size=64)
    assert got.equal(expect) and got.name == expect.name


def test_from_spec_defaults_and_heads():
    sw = patterns.from_spec("sliding_window", seqlen=4096, block_size=64)
    bb = patterns.from_spec("bigbird", seqlen=4096, block_size=64)
    assert 0.08 <= sw.density <= 0.12, sw
    assert 0.12 <= bb.density <= 0.18, bb
    for name in patterns.available():
        lo = patterns.from_spec(name, seqlen=1000, block_size=(32, 64), num_heads=2)
        assert lo.seqlen == (1000, 1000) and lo.block_size == (32, 64) and lo.nnz_blocks > 0
        assert lo.layout_heads == (2 if name in ("bigbird", "random") else 1)
    heads = patterns.from_spec("random:0.1,heads=3", seqlen=512, block_size=32)
    assert heads.layout_heads == 3
    assert patterns.get("bigbird", 512, 32, num_heads=2, seed=4).equal(
        patterns.bigbird(512, 32, num_heads=2, seed=4))


@pytest.mark.parametrize("spec,exc,match", [
    ("nope", ValueError, "known patterns: .*sliding_window"),
    ("sliding_window:512,256", ValueError, "positional"),
    ("sliding_window:width=3", ValueError, "no parameter 'width'"),
    ("sliding_window:abc", ValueError, "cannot read value"),
    ("sliding_window:-1", ValueError, "window must be >= 0"),
    ("sliding_window:1.5", TypeError, "window must be an int"),
    ("random:1.5", ValueError, r"density must be a number in \[0, 1\]"),
    ("causal:causal=false", ValueError, "use 'dense'"),
    ("document:lengths=10/20", ValueError, "cover seqlen = 4096"),
    ("", ValueError, "non-empty string"),
])
def test_from_spec_errors(spec, exc, match):
    with pytest.raises(exc, match=match):
        patterns.from_spec(spec, seqlen=4096, block_size=64)


def test_builder_errors():
    with pytest.raises(TypeError, match="block_size must be an int"):
        patterns.causal(128, 16.0)
    with pytest.raises(ValueError, match="seqlen must be positive"):
        patterns.dense(0, 16)
    with pytest.raises(TypeError, match="causal must be True or False"):
        patterns.sliding_window(128, 16, 8, causal=1)
    with pytest.raises(ValueError, match="summary must be <= stride"):
        patterns.fixed(128, 16, 8, 9)
    with pytest.raises(ValueError, match="global_tokens must lie in"):
        patterns.longformer(128, 16, 8, [200])
    with pytest.raises(TypeError, match="global_tokens must be an int count"):
        patterns.longformer(128, 16, 8, 1.5)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        patterns.document([0, 10, 5], 16)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        patterns.document(torch.tensor([0.0, 10.0]), 16)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        patterns.random(128, 16, 0.5, num_heads=0)
    with pytest.raises(ValueError, match="unknown parameter"):
        patterns.get("dense", 128, 16, window=3)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_fuzz_interval_patterns(data):
    """Random sizes and parameters for the patterns whose block logic is interval arithmetic."""
    bq, bk = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    sq, sk = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 60))
    causal = data.draw(st.booleans())
    q, k = qk((sq, sk))
    which = data.draw(st.sampled_from(["window", "strided", "fixed", "document"]))
    if which == "window":
        w = data.draw(st.integers(0, 70))
        check(patterns.sliding_window((sq, sk), (bq, bk), w, causal=causal), elem_window(q, k, w, causal),
              (bq, bk))
    elif which == "strided":
        s_ = data.draw(st.integers(1, 30))
        check(patterns.strided((sq, sk), (bq, bk), s_, causal=causal), elem_strided(q, k, s_, causal),
              (bq, bk))
    elif which == "fixed":
        l_ = data.draw(st.integers(1, 30))
        c_ = data.draw(st.integers(1, l_))
        check(patterns.fixed((sq, sk), (bq, bk), l_, c_, causal=causal), elem_fixed(q, k, l_, c_, causal),
              (bq, bk))
    else:
        lengths = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=6).filter(lambda x: sum(x) > 0))
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        check(patterns.document(cu, bq, causal=causal), elem_document(cu, causal), bq)


HUGE = 10 ** 23
#: every positional parameter of every spec, set far past the sequence
HUGE_SPECS = [pytest.param(f"{name}:" + ",".join(["1"] * i + [str(HUGE)]), id=f"{name}-{param}")
              for name, params in patterns.SPEC_PARAMS.items() for i, param in enumerate(params)]
HUGE_SPECS += [pytest.param(f"sliding_window:{HUGE},causal", id="sliding_window-causal"),
               pytest.param(f"random:0.1,seed={HUGE}", id="random-seed"),
               pytest.param(f"random:0.1,heads={HUGE}", id="random-heads")]


@pytest.mark.parametrize("spec", HUGE_SPECS)
def test_spec_parameter_past_the_sequence_named_or_refused(spec):
    """A parameter past the sequence either builds a layout whose name states the value asked for
    (and whose mask is the one the definition gives) or is refused with a ValueError."""
    try:
        layout = patterns.from_spec(spec, 48, (8, 16))
    except ValueError as e:
        assert str(HUGE) in str(e) or "must be" in str(e)
        return
    assert str(HUGE) in layout.name, (spec, layout.name)


@pytest.mark.parametrize("build,reference", [
    pytest.param(lambda n: patterns.sliding_window(n, 8, window=HUGE), lambda n: patterns.dense(n, 8), id="sliding_window"),
    pytest.param(lambda n: patterns.strided(n, 8, stride=HUGE, causal=True), lambda n: patterns.causal(n, 8), id="strided"),
    pytest.param(lambda n: patterns.fixed(n, 8, stride=HUGE, summary=3), lambda n: patterns.dense(n, 8), id="fixed"),
    pytest.param(lambda n: patterns.prefix_lm(n, 8, prefix=HUGE), lambda n: patterns.dense(n, 8), id="prefix_lm"),
    pytest.param(lambda n: patterns.longformer(n, 8, window=HUGE, global_tokens=0), lambda n: patterns.dense(n, 8),
                 id="longformer"),
])
def test_parameter_past_the_sequence_gives_the_definition(build, reference):
    n = 37
    assert torch.equal(build(n).to_dense_mask(), reference(n).to_dense_mask())


def test_document_spec_refuses_more_documents_than_positions():
    with pytest.raises(ValueError, match="num_docs must be <= 40"):
        patterns.from_spec("document:41", 40, 8)
