"""Router readings (Sinkhorn, causal soft and hard groups, sinks) and the pair count of the hard pattern."""
from __future__ import annotations

import pytest
import torch

from sieve_attn import focus_attention
from sieve_attn.ops.focus.reference import count_attended_pairs
from sieve_attn.ops.focus import routing
from sieve_attn.ops.focus.routing import (causal_log_assign, document_starts, hard_groups, sink_positions, sinkhorn,
                                          with_sinks_soft)

F64 = torch.float64


def naive_sinkhorn(logits, iters):
    """Probability-space Sinkhorn in float64: scale every group's column, then every token's row, `iters` times."""
    p = torch.exp(logits.to(F64) - logits.to(F64).amax(dim=(1, 2), keepdim=True))
    for _ in range(iters):
        p = p / p.sum(dim=1, keepdim=True)
        p = p / p.sum(dim=2, keepdim=True)
    return p


def pattern_mask(groups, window, causal, q_len):
    """bool [B, Tq, Tk] of the hard pattern, from DESIGN.md, with plain Python sets (small T only)."""
    batch, length, _ = groups.shape
    mask = torch.zeros(batch, q_len, length, dtype=torch.bool)
    for b in range(batch):
        sets = [set(int(x) for x in groups[b, t] if int(x) >= 0) for t in range(length)]
        for row in range(q_len):
            i = length - q_len + row
            for j in range(length):
                if causal and j > i:
                    continue
                mask[b, row, j] = 0 <= i - j <= window or bool(sets[i] & sets[j])
    return mask


# ----------------------------------------------------------------------------------------------------------------
# Sinkhorn
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("iters", [10, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinkhorn_rows_columns_potentials(iters, dtype):
    torch.manual_seed(0)
    batch, length, num_groups = 2, 64, 4
    logits = (torch.randn(batch, length, num_groups) * 2).to(dtype)
    log_assign, potentials = sinkhorn(logits, iters)
    assert log_assign.shape == (batch, length, num_groups) and potentials.shape == (batch, num_groups)
    assert log_assign.dtype == torch.float32
    assign = log_assign.exp()
    torch.testing.assert_close(assign.sum(-1), torch.ones(batch, length), rtol=0, atol=1e-5)
    torch.testing.assert_close(assign.sum(1), torch.full((batch, num_groups), length / num_groups), rtol=0.02, atol=0)
    torch.testing.assert_close(log_assign, torch.log_softmax(logits.float() + potentials[:, None], dim=-1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(assign.double(), naive_sinkhorn(logits, iters), rtol=1e-4, atol=1e-5)


def test_sinkhorn_balances_skewed_logits():
    # Logits that favour group 0 for every token: the softmax is far from balanced, Sinkhorn must balance it.
    torch.manual_seed(1)
    logits = torch.randn(1, 48, 3)
    logits[..., 0] += 2.0
    plain = torch.softmax(logits, -1).sum(1)
    assert plain[0, 0] > 30
    log_assign, _ = sinkhorn(logits, 30)
    torch.testing.assert_close(log_assign.exp().sum(1), torch.full((1, 3), 16.0), rtol=0.01, atol=0)


def test_sinkhorn_gradients_flow():
    torch.manual_seed(2)
    logits = (torch.randn(2, 32, 4) * 2).requires_grad_(True)
    weights = torch.randn(2, 32, 4)
    log_assign, _ = sinkhorn(logits, 10)
    (grad,) = torch.autograd.grad((log_assign.exp() * weights).sum(), logits)
    assert torch.isfinite(grad).all() and grad.abs().max() > 1e-3
    ref_logits = logits.detach().double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((naive_sinkhorn(ref_logits, 10) * weights.double()).sum(), ref_logits)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-3, atol=1e-4)


def test_causal_log_assign():
    torch.manual_seed(3)
    logits = torch.randn(2, 10, 5, dtype=torch.bfloat16)
    bias = torch.randn(5)
    got = causal_log_assign(logits, bias)
    shifted = logits.double() + bias.double()
    expected = shifted - torch.logsumexp(shifted, dim=-1, keepdim=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # A token's membership depends on nothing but itself.
    logits2 = logits.clone()
    logits2[:, 5:] = torch.randn(2, 5, 5, dtype=torch.bfloat16)
    assert torch.equal(causal_log_assign(logits2, bias)[:, :5], got[:, :5])


# ----------------------------------------------------------------------------------------------------------------
# Hard groups and sinks
# ----------------------------------------------------------------------------------------------------------------

def _expected_top(logits, bias, top_k):
    return (logits.double() + bias.double()).argsort(dim=-1, descending=True)[..., :top_k].sort(dim=-1).values


@pytest.mark.parametrize("first_position,sink_tokens,expected_sinks", [(0, 2, 2), (1, 2, 1), (0, 0, 0), (2, 2, 0),
                                                                       (5, 2, 0), (0, 50, 10)])
def test_hard_groups(first_position, sink_tokens, expected_sinks):
    torch.manual_seed(4)
    batch, length, num_groups, top_k = 2, 10, 6, 2
    logits = torch.randn(batch, length, num_groups)
    bias = torch.randn(num_groups)
    ids = hard_groups(logits, bias, top_k, sink_positions(batch, first_position, length, sink_tokens, "cpu"))
    width = num_groups if expected_sinks else top_k
    assert ids.shape == (batch, length, width)
    if expected_sinks:
        every = torch.arange(num_groups).expand(batch, expected_sinks, num_groups)
        assert torch.equal(ids[:, :expected_sinks].sort(dim=-1).values, every)
    rest = ids[:, expected_sinks:]
    top = _expected_top(logits, bias, top_k)[:, expected_sinks:]
    assert torch.equal(rest[..., :top_k].sort(dim=-1).values, top)
    assert torch.all(rest[..., top_k:] == -1)
    # The result is a valid `groups` argument: focus_attention accepts it.
    q = torch.randn(batch, 2, length, 8)
    focus_attention(q, q, q, ids, window=1)


def test_hard_groups_top_k_equals_num_groups():
    torch.manual_seed(5)
    logits = torch.randn(2, 7, 4)
    ids = hard_groups(logits, torch.zeros(4), 4, sink_positions(2, 0, 7, 3, "cpu"))
    assert ids.shape == (2, 7, 4)
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(4).expand(2, 7, 4))


@pytest.mark.parametrize("first_position,sink_tokens,expected_sinks", [(0, 3, 3), (1, 3, 2), (5, 3, 0), (3, 3, 0),
                                                                       (0, 0, 0), (0, 99, 10)])
def test_with_sinks_soft(first_position, sink_tokens, expected_sinks):
    torch.manual_seed(6)
    assign = torch.softmax(torch.randn(2, 10, 4), dim=-1)
    got = with_sinks_soft(assign, sink_positions(2, first_position, 10, sink_tokens, "cpu"))
    assert got.shape == assign.shape
    assert torch.all(got[:, :expected_sinks] == 1)
    assert torch.equal(got[:, expected_sinks:], assign[:, expected_sinks:])


@pytest.mark.parametrize("first_position, expected", [
    (0, [[False, False, True, True, False, False], [True, True, False, True, True, False]]),
    (3, [[True, False, False], [True, True, False]]),
    (5, None)])
def test_sinks_start_at_each_document_start(first_position, expected):
    """Row 0 left-padded by 2 slots: its 2 sinks are positions 2 and 3; row 1 packs two sequences, from 0 and 3:
    sinks 0, 1, 3 and 4. A chunk past every sink has none (None: no tensor work)."""
    length = 6 - first_position if first_position < 5 else 2
    got = sink_positions(2, first_position, length, 2, "cpu", sink_starts=[[2], [0, 3]])
    assert (got is None) if expected is None else torch.equal(got, torch.tensor(expected))
    if got is not None:
        ids = hard_groups(torch.randn(2, length, 5), torch.zeros(5), 1, got)
        assert torch.equal((ids >= 0).sum(-1) == 5, got)  # sinks list every group, the others one


def _causal_mask(length: int, documents: list[int], pads: int = 0, window: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] bool as transformers builds it: ``pads`` left pads that attend nothing and no one attends,
    then sequences of the ``documents`` lengths, each causal within itself, with a sliding ``window``."""
    document = torch.full((length,), -1)
    document[pads:] = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    mask = (document[:, None] == document[None]) & (document[None] >= 0) & (j <= i)
    if window is not None:
        mask &= i - j < window
    return mask[None, None]


def test_document_starts_from_masks():
    assert document_starts(_causal_mask(8, [8]), 0, 8) == [[0]]
    assert document_starts(_causal_mask(8, [5], pads=3), 0, 8) == [[3]]
    assert document_starts(_causal_mask(9, [4, 2, 3]), 0, 9) == [[0, 4, 6]]
    assert document_starts(_causal_mask(9, [2, 4, 3], pads=0, window=2), 0, 9) == [[0, 2, 6]]
    rows = torch.cat([_causal_mask(7, [7]), _causal_mask(7, [3, 3], pads=1)])
    assert document_starts(rows, 0, 7) == [[0], [1, 4]]
    # A chunk of queries 5.. over every key: starts at absolute positions; one over the last 4 keys of a
    # sliding-window cache (its first query's predecessor is key 0 there).
    full = _causal_mask(9, [4, 2, 3])
    assert document_starts(full[..., 5:, :], 5, 9) == [[6]]
    assert document_starts(full[..., 5:, 5:], 5, 4) == [[6]]
    assert document_starts(full[..., 6:, 6:], 6, 3) == [[]]  # 6's predecessor is gone: it continues


def test_document_starts_read_in_chunks_of_queries(monkeypatch):
    """Candidate queries are scanned a few at a time; any chunking gives the starts read at once."""
    masks = torch.cat([_causal_mask(11, [4, 2, 5]), _causal_mask(11, [3, 6], pads=2)])
    expected = [[0, 4, 6], [2, 5]]
    for rows_per_read in (1, 3, 4, 11):
        monkeypatch.setattr(routing, "_ROWS_PER_READ", rows_per_read)
        assert document_starts(masks, 0, 11) == expected
        assert document_starts(masks[..., 5:, :], 5, 11) == [[6], [5]]
    shared = _causal_mask(11, [4, 2, 5]).expand(3, 1, 11, 11)  # one mask for the batch, as a stride-0 view
    assert document_starts(shared, 0, 11) == [[0, 4, 6]]


def test_a_tree_of_draft_tokens_is_refused_and_a_masked_token_is_skipped():
    """Speculative decoding's tree mask: after a 4-token prompt, drafts 4 and 5 both follow token 3, 6 follows 4 and
    7 follows 5. Draft 5 attends the prompt but not draft 4: Focus's window counts slots, so it would see another
    window than on its own path; refused. A token masked out (it attends not even itself, as transformers masks a
    0 of the attention mask) is no such token: the one after it continues the sequence."""
    parents = {4: 3, 5: 3, 6: 4, 7: 5}
    tree = torch.ones(8, 8).tril().bool()
    tree[4:, 4:] = torch.eye(4, dtype=torch.bool)
    for token, parent in parents.items():
        while parent >= 4:
            tree[token, parent] = True
            parent = parents[parent]
    assert not tree[5, 4] and not tree[7, 6] and tree[7, 5] and tree[7, 3]
    for queries, start in ((tree, 0), (tree[4:], 4)):
        with pytest.raises(ValueError, match=r"attn_mask: .*window.* position 5 attends earlier tokens but not "
                                             r"position 4"):
            document_starts(queries[None, None], start, 8)
    holed = _causal_mask(8, [8])
    holed[..., 3] = False  # token 3 masked out as a key, its own row too
    assert document_starts(holed, 0, 8) == [[0]]
    assert document_starts(holed[..., 2:, :], 2, 8) == [[]]
    holed[..., 5, 4] = False  # query 5 masks its own slot and the one before: no token of the sequence, no tree
    holed[..., 5, 5] = False
    assert document_starts(holed, 0, 8) == [[0]]
    with pytest.raises(ValueError, match=r"attn_mask: expected one column per key present \(8\), got 9 columns"):
        document_starts(_causal_mask(9, [9])[..., 1:, :], 1, 8)


# ----------------------------------------------------------------------------------------------------------------
# Pair counts
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len", [None, 1, 9])
@pytest.mark.parametrize("window", [0, 3])
def test_count_attended_pairs(causal, q_len, window):
    torch.manual_seed(7)
    batch, length = 2, 29
    ids = torch.rand(batch, length, 6).argsort(dim=-1)[..., :2]
    groups = ids.masked_fill(torch.rand(batch, length, 2) < 0.3, -1)
    groups[..., 0] = ids[..., 0]  # every token keeps one group
    tq = length if q_len is None else q_len
    attended, candidates = count_attended_pairs(groups, window, causal=causal, q_len=q_len)
    assert attended == int(pattern_mask(groups, window, causal, tq).sum())
    if causal:
        assert candidates == int(pattern_mask(groups, 10 ** 6, causal, tq).sum())
    else:
        assert candidates == batch * tq * length


@pytest.mark.parametrize("q_len", [None, 5])
def test_count_attended_pairs_full_window(q_len):
    torch.manual_seed(8)
    batch, length = 2, 31
    groups = torch.arange(length).expand(batch, length)[..., None].contiguous()  # nobody shares a group
    tq = length if q_len is None else q_len
    causal_pairs = batch * sum(length - tq + r + 1 for r in range(tq))
    for window in (length - 1, length, length + 7):
        assert count_attended_pairs(groups, window, q_len=q_len) == (causal_pairs, causal_pairs)
    attended, candidates = count_attended_pairs(groups, length - 2, q_len=q_len)
    assert candidates == causal_pairs and attended == causal_pairs - batch  # only pair (T-1, 0) is lost
