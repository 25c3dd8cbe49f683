"""FocusGroups (validated memberships of a decoder's cache) and the log-sum-exp merge of partial results."""
from __future__ import annotations

import pytest
import torch

from sieve_attn import FocusGroups, focus_attention
from sieve_attn.ops.focus.reference import group_bits
from sieve_attn.ops import merge as merge_module
from sieve_attn.ops.merge import merge_extra_partials, merge_partials


def test_extend_and_span_keep_ids_bits_and_group_count():
    first = FocusGroups.of(torch.tensor([[0, 2, 1]]), 1, 3, "cpu")
    second = FocusGroups.of(torch.tensor([[[3, -1], [0, 4]]]), 1, 2, "cpu")
    joined = first.extend(second)
    assert joined.ids.tolist() == [[[0, -1], [2, -1], [1, -1], [3, -1], [0, 4]]]
    assert torch.equal(joined.bits, group_bits(joined.ids)) and joined.num_groups == 5
    assert joined.last(2).ids.tolist() == [[[3, -1], [0, 4]]] and joined.span(1, 3).bits.tolist() == [[4, 2]]


@pytest.mark.parametrize("ids, has_bits", [(torch.tensor([[[0, 5], [62, -1]]]), True),
                                           (torch.tensor([[[0, 5], [63, -1]]]), False)])
def test_validation_reads_the_device_once(ids, has_bits, monkeypatch):
    """One host read (the validation's), bit sets included: a second would stall the GPU again at every call."""
    reads = []
    for method in ("tolist", "item", "__int__", "__bool__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _m=method: reads.append(_m)
                            or _f(self, *a))
    groups = FocusGroups.of(ids, 1, 2, "cpu")
    monkeypatch.undo()
    assert reads == ["tolist"] and (groups.bits is not None) == has_bits
    if has_bits:
        assert torch.equal(groups.bits, group_bits(ids))


def test_validation_drops_slots_no_token_fills():
    """A slot empty for every token (a top-2 tensor of top-1 routing) is dropped, so one membership per token takes
    the one-membership paths of the backends; the pattern is the same."""
    ids = torch.tensor([[[-1, 2, -1], [0, -1, -1], [-1, 1, -1]], [[1, -1, -1], [-1, 0, -1], [2, -1, -1]]])
    groups = FocusGroups.of(ids, 2, 3, "cpu")
    assert groups.ids.tolist() == [[[-1, 2], [0, -1], [-1, 1]], [[1, -1], [-1, 0], [2, -1]]]
    assert torch.equal(groups.bits, group_bits(ids)) and groups.num_groups == 3
    q = torch.randn(2, 2, 3, 8)
    one_each = ids.amax(-1)  # [B, T]: each token's one id
    assert torch.equal(focus_attention(q, q, q, ids, window=0, backend="sdpa"),
                       focus_attention(q, q, q, one_each, window=0, backend="sdpa"))


def test_validated_groups_are_not_validated_again_and_must_fit_the_call():
    q = torch.randn(1, 2, 4, 8)
    groups = FocusGroups.of(torch.tensor([[0, 1, 0, 1]]), 1, 4, "cpu")
    assert torch.equal(focus_attention(q, q, q, groups, window=1), focus_attention(q, q, q, groups.ids, window=1))
    with pytest.raises(ValueError, match=r"groups: expected FocusGroups of ids \[B=1, T=5, m\]"):
        focus_attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), groups)


def test_groups_built_by_hand_are_validated_and_their_bits_recomputed():
    """The kernels index memory by ids and bits: FocusGroups not built by of/routed are checked like raw ids, and
    their bits (which may disagree with the ids) recomputed."""
    q = torch.randn(1, 2, 4, 8)
    ids = torch.tensor([[[0], [1], [0], [1]]])
    wrong_bits = FocusGroups(ids, torch.full((1, 4), 12), 2)
    assert torch.equal(focus_attention(q, q, q, wrong_bits, window=1), focus_attention(q, q, q, ids, window=1))
    with pytest.raises(ValueError, match="groups: expected FocusGroups whose num_groups bounds its ids \\(at least "
                                         "2\\), got 1"):
        focus_attention(q, q, q, FocusGroups(ids, None, 1), window=1)
    with pytest.raises(ValueError, match="groups: expected group ids >= -1"):
        focus_attention(q, q, q, FocusGroups(ids - 2, None, 2), window=1)
    with pytest.raises(ValueError, match=r"groups: expected FocusGroups of ids \[B=1, T=4, m\] on cpu, got ids "):
        focus_attention(q, q, q, FocusGroups(ids[..., 0], None, 2), window=1)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0, -2, 1]]), "group ids >= 0"),
    (torch.tensor([[[0, 0], [1, -1], [2, -1]]]), "distinct group ids"),
    (torch.tensor([[[0, -1], [-1, -1], [2, -1]]]), "every token in at least one group"),
])
def test_bad_memberships_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        FocusGroups.of(bad, 1, 3, "cpu")


def _key_set_partials(scores, v, sets):
    """(out [len(sets), D], lse [len(sets)]) of one query row over each key set; an empty set gives 0 and -inf."""
    outs = [torch.softmax(scores[keys], 0) @ v[keys] if len(keys) else torch.zeros(v.shape[1]) for keys in sets]
    return torch.stack(outs), torch.stack([torch.logsumexp(scores[keys], 0) for keys in sets])


def test_merge_of_extra_partials_equals_attention_over_the_union():
    """Two disjoint key sets of one query row, merged by log-sum-exp, give attention over all keys; rows without an
    extra partial are untouched."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4), torch.randn(6, 4), torch.randn(6, 4)
    scores = k @ q
    (o1, o2), (l1, l2) = _key_set_partials(scores, v, [[0, 1], [2, 3, 4, 5]])
    out = torch.stack([o1, torch.ones(4)])[None, None].clone()       # [B=1, H=1, T=2, D]
    lse = torch.stack([l1, torch.tensor(0.5)])[None, None].clone()
    merge_extra_partials(out, lse, o2[None, None], l2[None, None], torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(scores, 0) @ v)
    torch.testing.assert_close(lse[0, 0, 0], torch.logsumexp(scores, 0))
    assert out[0, 0, 1].tolist() == [1.0] * 4 and lse[0, 0, 1].item() == 0.5


def test_merge_of_partials_by_row_matches_fp64_and_gives_fully_masked_rows_zero_without_nan():
    """Row 0: a base and two more partials (one an empty set); row 1: only empty sets (out 0, lse -inf, finite
    gradients); row 2: the base alone. Float32 merge against attention over the union in float64."""
    torch.manual_seed(1)
    scores, v = torch.randn(9, dtype=torch.float64) * 3, torch.randn(9, 4, dtype=torch.float64)
    base_out, base_lse = _key_set_partials(scores, v, [[0, 1], [], [5, 6, 7, 8]])
    out_rows, lse_rows = _key_set_partials(scores, v, [[2, 3, 4], [], []])
    base = tuple(t.float()[:, None].requires_grad_() for t in (base_out, base_lse))  # H = 1
    rows = [t.float()[:, None].requires_grad_() for t in (out_rows, lse_rows)]
    out, lse = merge_partials(base, *rows, torch.tensor([0, 0, 1]), 3)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out[0, 0].double(), torch.softmax(scores[:5], 0) @ v[:5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[0, 0].double(), torch.logsumexp(scores[:5], 0), rtol=1e-6, atol=1e-6)
    assert out[1].eq(0).all() and lse[1].item() == float("-inf")
    torch.testing.assert_close(out[2, 0].double(), base_out[2], rtol=1e-6, atol=1e-6)
    (out.sum() + lse[[0, 2]].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (*base, *rows))


def test_merge_of_extra_partials_takes_several_per_token():
    """Token 1 gets three extra partials (one over an empty set), interleaved with one for token 0; token 2 none."""
    torch.manual_seed(2)
    scores, v = torch.randn(3, 8), torch.randn(8, 4)
    base = [_key_set_partials(scores[t], v, [[0, 1]]) for t in range(3)]
    out = torch.cat([o for o, _ in base])[None, None].clone()  # [B=1, H=1, T=3, D]
    lse = torch.cat([l for _, l in base])[None, None].clone()
    extra_out, extra_lse = zip(*(_key_set_partials(scores[t], v, [keys]) for t, keys in
                                 [(1, [2, 3]), (0, [2, 3, 4, 5, 6, 7]), (1, []), (1, [4, 5, 6])]))
    merge_extra_partials(out, lse, torch.cat(extra_out)[:, None], torch.cat(extra_lse)[:, None],
                         torch.zeros(4, dtype=torch.long), torch.tensor([1, 0, 1, 1]))
    for t, keys in enumerate([slice(0, 8), slice(0, 7), slice(0, 2)]):
        torch.testing.assert_close(out[0, 0, t], torch.softmax(scores[t, keys], 0) @ v[keys])
        torch.testing.assert_close(lse[0, 0, t], torch.logsumexp(scores[t, keys], 0))


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_merge_of_one_extra_partial_per_token_takes_one_pass(kernel, monkeypatch):
    """The one-per-row pass (one kernel on CUDA) gives what the merge of all partials at once gives; token 1 gets
    no extra, token 3's is over an empty set."""
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(merge_module, "merge_indexed", merge_module.merge_indexed_triton)
    torch.manual_seed(3)
    scores, v = torch.randn(2, 4, 8), torch.randn(8, 3)
    base = [[_key_set_partials(scores[b, t], v, [[0, 1]]) for t in range(4)] for b in range(2)]
    out = torch.stack([torch.stack([o[:, None] for o, _ in row], 2) for row in base])[:, 0]  # [B=2, H=1, T=4, D]
    lse = torch.stack([torch.stack([l for _, l in row], 1) for row in base])              # [B, H, T]
    extra_out, extra_lse = zip(*(_key_set_partials(scores[b, t], v, [keys]) for b, t, keys in
                                 [(0, 2, [2, 3]), (1, 0, [2, 5]), (0, 0, [4, 5, 6]), (0, 3, []), (1, 3, [7])]))
    extras = (torch.cat(extra_out)[:, None], torch.cat(extra_lse)[:, None], torch.tensor([0, 1, 0, 0, 1]),
              torch.tensor([2, 0, 0, 3, 3]))
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    out, lse, extras = out.to(device), lse.to(device), tuple(t.to(device) for t in extras)
    want_out, want_lse = out.clone(), lse.clone()
    merge_extra_partials(want_out, want_lse, *extras)
    merge_extra_partials(out, lse, *extras, one_per_row=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert torch.equal(out[0, 0, 1].cpu(), torch.stack([o for o, _ in base[0]])[1, 0])  # no extra: untouched


def test_decode_checks_only_new_tokens_for_nan_and_refuses_them():
    q = torch.randn(1, 2, 1, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    groups = torch.zeros(1, 5, dtype=torch.long)
    k[0, 0, -1, 0] = float("nan")
    with pytest.raises(ValueError, match="k: expected no NaN"):
        focus_attention(q, k, v, groups)


def test_routed_groups_equal_validated_ones_without_reading_them_on_the_host(monkeypatch):
    """FocusGroups.routed takes the router's hard_groups output (sink rows listing every group, the others their
    top-k) as FocusGroups.of would validate it, bit sets included, without one host read of the values."""
    from sieve_attn.ops.focus.routing import hard_groups, sink_positions

    logits = torch.randn(2, 9, 5, generator=torch.Generator().manual_seed(0))
    ids = hard_groups(logits, torch.zeros(5), top_k=2, sinks=sink_positions(2, 0, 9, 1, "cpu"))
    validated = FocusGroups.of(ids, 2, 9, ids.device)

    def host_read(*args, **kwargs):
        raise AssertionError("a host read of tensor values")

    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    routed = FocusGroups.routed(ids, 5)
    monkeypatch.undo()
    assert torch.equal(routed.ids, validated.ids) and torch.equal(routed.bits, validated.bits)
    assert routed.num_groups == 5 >= validated.num_groups
