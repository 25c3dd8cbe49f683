"""FocusGroups (validated memberships of a decoder's cache) and the log-sum-exp merge of partial results."""
from __future__ import annotations

import pytest
import torch

from sieve_attn import FocusGroups, focus_attention
from sieve_attn.ops.focus.reference import group_bits
from sieve_attn.ops.merge import merge_extra_partials


def test_extend_and_span_keep_ids_bits_and_group_count():
    first = FocusGroups.of(torch.tensor([[0, 2, 1]]), 1, 3, "cpu")
    second = FocusGroups.of(torch.tensor([[[3, -1], [0, 4]]]), 1, 2, "cpu")
    joined = first.extend(second)
    assert joined.ids.tolist() == [[[0, -1], [2, -1], [1, -1], [3, -1], [0, 4]]]
    assert torch.equal(joined.bits, group_bits(joined.ids)) and joined.num_groups == 5
    assert joined.last(2).ids.tolist() == [[[3, -1], [0, 4]]] and joined.span(1, 3).bits.tolist() == [[4, 2]]


def test_validated_groups_are_not_validated_again_and_must_fit_the_call():
    q = torch.randn(1, 2, 4, 8)
    groups = FocusGroups.of(torch.tensor([[0, 1, 0, 1]]), 1, 4, "cpu")
    assert torch.equal(focus_attention(q, q, q, groups, window=1), focus_attention(q, q, q, groups.ids, window=1))
    with pytest.raises(ValueError, match="groups: expected FocusGroups of B=1, T=5"):
        focus_attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), groups)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0, -2, 1]]), "group ids >= 0"),
    (torch.tensor([[[0, 0], [1, -1], [2, -1]]]), "distinct group ids"),
    (torch.tensor([[[0, -1], [-1, -1], [2, -1]]]), "every token in at least one group"),
])
def test_bad_memberships_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        FocusGroups.of(bad, 1, 3, "cpu")


def test_merge_of_extra_partials_equals_attention_over_the_union():
    """Two disjoint key sets of one query row, merged by log-sum-exp, give attention over all keys; rows without an
    extra partial are untouched."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4), torch.randn(6, 4), torch.randn(6, 4)
    scores = k @ q

    def partial(keys):
        return torch.softmax(scores[keys], 0) @ v[keys], torch.logsumexp(scores[keys], 0)

    (o1, l1), (o2, l2) = partial(slice(0, 2)), partial(slice(2, 6))
    out = torch.stack([o1, torch.ones(4)])[None, None].clone()       # [B=1, H=1, T=2, D]
    lse = torch.stack([l1, torch.tensor(0.5)])[None, None].clone()
    merge_extra_partials(out, lse, o2[None, None], l2[None, None], torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(scores, 0) @ v)
    torch.testing.assert_close(lse[0, 0, 0], torch.logsumexp(scores, 0))
    assert out[0, 0, 1].tolist() == [1.0] * 4 and lse[0, 0, 1].item() == 0.5


def test_decode_checks_only_new_tokens_for_nan_and_refuses_them():
    q = torch.randn(1, 2, 1, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    groups = torch.zeros(1, 5, dtype=torch.long)
    k[0, 0, -1, 0] = float("nan")
    with pytest.raises(ValueError, match="k: expected no NaN"):
        focus_attention(q, k, v, groups)
