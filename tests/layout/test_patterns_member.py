"""Pattern machinery at scale: sorted-set membership (``_member``) and the ``documents`` spec alias."""
import torch

from sparse_io_attn.layout.patterns import from_spec
from sparse_io_attn.layout.patterns._grid import _member


def test_member_equals_isin():
    keys = torch.unique(torch.randint(-50, 50, (40,)))           # sorted, unique
    x = torch.randint(-60, 60, (7, 30))
    assert torch.equal(_member(x, keys), torch.isin(x, keys))
    assert not _member(x, keys[:0]).any() and _member(x, keys[:0]).shape == x.shape
    assert torch.equal(_member(keys, keys), torch.ones_like(keys, dtype=torch.bool))


def test_documents_alias_builds_document():
    a, b = from_spec("documents:3,causal", 100, 16), from_spec("document:3,causal", 100, 16)
    assert a.equal(b) and a.name == b.name
