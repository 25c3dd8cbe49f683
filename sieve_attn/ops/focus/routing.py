"""Turning router logits into group memberships.

Router logits are L [B, T, K] = (W_g h) C^T / tau (tau applied once). Three readings of them:

- training: log-domain Sinkhorn over the tokens of each sequence (the paper's normalisation). It balances the groups
  but makes a token's membership depend on every other token of the sequence, future ones included.
- causal soft: softmax_k(L + b), where b [K] are per-group biases. Sinkhorn's result is exactly softmax_k(L + v) for
  column potentials v it accumulates; b is their running average, so causal routing reproduces the balance learned in
  training while a token's membership depends on nothing but itself (docs/decisions.md, decision 1).
- causal hard: the top-k groups of L + b.

Sink tokens (the first ``sink_tokens`` tokens of a sequence, which pretrained models use as attention sinks) are
members of every group: a row of ones in the soft forms, all K ids in the hard form. A row of a batch may start
later than position 0 (left padding), or hold several sequences one after another (packing): ``sink_starts`` gives
each row's document starts.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..._checks import check_int, fail


def sinkhorn(logits: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-domain Sinkhorn in float32 over dims (tokens, groups) of logits [B, T, K].

    Each iteration normalises every group's mass over the tokens, then every token's row over the groups, so rows
    sum to 1 on return. Gradients flow through every iteration.

    Returns (log_assign [B, T, K], potentials [B, K]) with log_assign == log_softmax(logits + potentials[:, None]).
    """
    iters = check_int("iters", iters, 1)
    log_q = logits.float()
    potentials = torch.zeros(logits.shape[0], logits.shape[2], device=logits.device, dtype=torch.float32)
    for _ in range(iters):
        column = torch.logsumexp(log_q, dim=1)  # [B, K]
        log_q = log_q - column[:, None]
        potentials = potentials - column
        log_q = log_q - torch.logsumexp(log_q, dim=2, keepdim=True)
    return log_q, potentials


def causal_log_assign(logits: torch.Tensor, group_bias: torch.Tensor) -> torch.Tensor:
    """log softmax_k(logits + group_bias): [B, T, K] from logits [B, T, K] and group_bias [K]."""
    return torch.log_softmax(logits.float() + group_bias.float(), dim=-1)


def sink_positions(batch: int, first_position: int, length: int, sink_tokens: int, device,
                   sink_starts: Optional[list[list[int]]] = None) -> Optional[torch.Tensor]:
    """[B, T] bool: which of positions first_position .. first_position + T - 1 are sinks, the ``sink_tokens``
    positions from each of a row's document starts (``sink_starts[b]``: a row's first real position, and with
    packing each later sequence's first; None: position 0 alone for every row); None where none is (no tensor
    work: decided on the host)."""
    starts = [[0]] * batch if sink_starts is None else sink_starts
    end = first_position + length
    marked = [(row, position - first_position) for row, row_starts in enumerate(starts) for start in row_starts
              for position in range(max(start, first_position), min(start + sink_tokens, end))]
    if not marked:
        return None
    rows, columns = torch.tensor(marked).unbind(1)
    sinks = torch.zeros(batch, length, dtype=torch.bool)
    sinks[rows, columns] = True
    return sinks.to(device)


# Mask rows document_starts scans at once for earlier keys: bounds its temporary to this many rows of keys.
_ROWS_PER_READ = 1024


def document_starts(attn_mask: torch.Tensor, start: int, k_len: int) -> list[list[int]]:
    """Absolute positions where a sequence begins among the queries of ``attn_mask`` [B or 1, H or 1, Tq, Tk] (bool,
    True = attend; queries at positions start.., aligned to the end of the keys), per mask row (one row for a mask
    shared along the batch, a stride-0 view included): a query that attends itself and no earlier key. Left padding
    gives each row's first real token (pads attend nothing, or not their own slot); packed sequences (transformers'
    block-diagonal mask from ``position_ids`` that restart) each one's first token. A query at the first key slot of
    a cache that dropped earlier tokens (a sliding window) continues its sequence unless it is position 0.

    Raises ValueError for a mask whose keys are not the ``k_len`` present, and for one in which a token attends
    earlier keys but skips the token just before it while that token, one of these queries, attends itself: a tree
    of draft tokens, as speculative decoding verifies them. Focus's window counts key slots, so such a token would
    see another window than in its sequence alone. (Masked tokens, pads among them, attend not even themselves: a
    token after them continues its sequence.)

    Cost: the mask's first head is read at two diagonals (every query); only the queries that attend themselves and
    not the slot before (every start and every skipping token is one: a handful per row) are scanned for earlier
    keys, ``_ROWS_PER_READ`` at a time. Two host reads."""
    mask = attn_mask[:1, 0] if attn_mask.stride(0) == 0 else attn_mask[:, 0]  # [B or 1, Tq, Tk]
    q_len = mask.shape[-2]
    if mask.shape[-1] != k_len:
        fail("attn_mask", f"one column per key present ({k_len})", f"{mask.shape[-1]} columns")
    queries = torch.arange(q_len, device=mask.device)
    own = queries + (k_len - q_len)  # each query's own key slot
    attends_itself = mask[:, queries, own]  # [B or 1, Tq]
    attends_previous = mask[:, queries, (own - 1).clamp_min(0)] & (own > 0)
    rows, candidates = (attends_itself & ~attends_previous).nonzero(as_tuple=True)
    attends_earlier = _attends_earlier(mask, rows, candidates, own)
    begins = torch.where(own[candidates] > 0, ~attends_earlier, candidates + start == 0)
    # The token before a candidate is one of these queries and attends itself (a live token it skips).
    previous_is_live = (candidates > 0) & attends_itself[rows, (candidates - 1).clamp_min(0)]
    skips_a_token = attends_earlier & previous_is_live
    rows, candidates, begins, skips_a_token = (t.cpu() for t in (rows, candidates, begins, skips_a_token))
    if skips_a_token.any():
        row, query = rows[skips_a_token][0].item(), candidates[skips_a_token][0].item()
        fail("attn_mask", "each token to attend the token just before it or no earlier token (Focus's window "
             "counts key slots; a tree of draft tokens cannot be verified in one pass)",
             f"in row {row} position {start + query} attends earlier tokens but not position {start + query - 1}")
    starts = [[] for _ in range(mask.shape[0])]
    for row, query in zip(rows[begins].tolist(), candidates[begins].tolist()):
        starts[row].append(start + query)
    return starts


def _attends_earlier(mask: torch.Tensor, rows: torch.Tensor, queries: torch.Tensor,
                     own: torch.Tensor) -> torch.Tensor:
    """[N] bool: whether query ``queries[n]`` of mask row ``rows[n]`` (``mask`` [B or 1, Tq, Tk]) attends a key
    before its own slot ``own[queries[n]]``, ``_ROWS_PER_READ`` rows of keys at a time."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    found = [(mask[rows[n:n + _ROWS_PER_READ], queries[n:n + _ROWS_PER_READ]]
              & (keys < own[queries[n:n + _ROWS_PER_READ], None])).any(-1)
             for n in range(0, len(rows), _ROWS_PER_READ)]
    return torch.cat(found) if found else rows.new_zeros(0, dtype=torch.bool)


def with_sinks_soft(assign: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """assign [B, T, K] with the rows of ``sinks`` ([B, T] bool, :func:`sink_positions`; None: none) all ones."""
    return assign if sinks is None else torch.where(sinks[..., None], torch.ones_like(assign), assign)


def hard_groups(logits: torch.Tensor, group_bias: torch.Tensor, top_k: int,
                sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Top-k group ids [B, T, m] of logits [B, T, K] + group_bias; ``sinks`` [B, T] bool marks sink tokens
    (:func:`sink_positions`; None: none).

    m = top_k, or K when a sink is among them (sink rows list every group, the other rows pad with -1).
    """
    num_groups = logits.shape[-1]
    ids = torch.topk(logits.float() + group_bias.float(), top_k, dim=-1).indices
    if sinks is None or top_k == num_groups:
        return ids
    padded = torch.cat([ids, ids.new_full((*ids.shape[:2], num_groups - top_k), -1)], dim=-1)
    every_group = torch.arange(num_groups, device=ids.device).expand_as(padded)
    return torch.where(sinks[..., None], every_group, padded)
