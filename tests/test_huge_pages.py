"""The native kernels' packed weights on 2 MiB pages (tandem/layers/huge_pages.py): where the machine gives them,
the weights move into one region with their values and the kernels' outputs unchanged; where it does not, or
TANDEM_HUGE_PAGES=0 says no, they stay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem import envs, native
from tandem.layers import huge_pages
from tandem.layers.huge_pages import HUGE_PAGE, huge_page_buffer, onto_huge_pages, transparent_huge_pages

pytestmark = pytest.mark.fast

offers_huge_pages = pytest.mark.skipif(transparent_huge_pages() not in ("always", "madvise"),
                                       reason="this kernel has no transparent huge pages to ask for")


class Packed(nn.Module):
    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.packed_weight = packed


@offers_huge_pages
def test_buffer_starts_on_a_huge_page_and_holds_what_was_asked():
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf is not None and buf.numel() == 3 * HUGE_PAGE + 5 and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)  # writable end to end
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * buf.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@offers_huge_pages
def test_packed_weights_move_into_one_region_with_the_kernels_outputs_unchanged(dtype):
    if not native.panels_available():
        pytest.skip("the panel kernels are not built for this CPU")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=dtype) for n, k in ((40, 24), (16, 8), (72, 24))]
    modules = [Packed(native.panel_pack(w)) for w in weights]
    x = {k: torch.randn(3, k, dtype=dtype) for k in (8, 24)}
    before = [native.panel_linear(x[w.shape[1]], m.packed_weight, w.shape[0], None)
              for w, m in zip(weights, modules, strict=True)]
    old = [m.packed_weight for m in modules]
    onto_huge_pages(modules)
    starts = [m.packed_weight.data_ptr() for m in modules]
    assert starts[0] % HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(g >= m.packed_weight.nbytes for g, m in zip(gaps, modules, strict=False)), "back to back"
    assert starts[-1] - starts[0] < HUGE_PAGE, "one region"
    for m, o, w, b in zip(modules, old, weights, before, strict=True):
        assert m.packed_weight.is_contiguous() and torch.equal(m.packed_weight, o)
        assert torch.equal(native.panel_linear(x[w.shape[1]], m.packed_weight, w.shape[0], None), b)


def test_weights_stay_where_huge_pages_are_refused(monkeypatch, tmp_path):
    packed = torch.randn(16, 8)
    module = Packed(packed)
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    assert huge_page_buffer(HUGE_PAGE) is None
    onto_huge_pages([module])
    assert module.packed_weight is packed
    monkeypatch.delenv("TANDEM_HUGE_PAGES")
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert transparent_huge_pages() == "never" and huge_page_buffer(HUGE_PAGE) is None
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert transparent_huge_pages() is None and huge_page_buffer(HUGE_PAGE) is None
    onto_huge_pages([module])
    assert module.packed_weight is packed


def test_a_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "yes")
    with pytest.raises(envs.EnvError, match="TANDEM_HUGE_PAGES='yes' is not allowed: 0 or 1"):
        huge_page_buffer(HUGE_PAGE)
