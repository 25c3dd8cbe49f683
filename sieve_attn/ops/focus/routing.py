"""Turning router logits into group memberships.

Router logits are L [B, T, K] = (W_g h) C^T / tau (tau applied once). Three readings of them:

- training: log-domain Sinkhorn over the tokens of each sequence (the paper's normalisation). It balances the groups
  but makes a token's membership depend on every other token of the sequence, future ones included.
- causal soft: softmax_k(L + b), where b [K] are per-group biases. Sinkhorn's result is exactly softmax_k(L + v) for
  column potentials v it accumulates; b is their running average, so causal routing reproduces the balance learned in
  training while a token's membership depends on nothing but itself (DESIGN.md, decision 1).
- causal hard: the top-k groups of L + b.

Sink tokens (the first ``sink_tokens`` positions of a sequence, which pretrained models use as attention sinks) are
members of every group: a row of ones in the soft forms, all K ids in the hard form.
"""
from __future__ import annotations

import torch

from ..._checks import check_int


def sinkhorn(logits: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-domain Sinkhorn in float32 over dims (tokens, groups) of logits [B, T, K].

    Each iteration normalises every group's mass over the tokens, then every token's row over the groups, so rows
    sum to 1 on return. Gradients flow through every iteration.

    Returns (log_assign [B, T, K], potentials [B, K]) with log_assign == log_softmax(logits + potentials[:, None]).
    """
    check_int("iters", iters, 1)
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


def with_sinks_soft(assign: torch.Tensor, first_position: int, sink_tokens: int) -> torch.Tensor:
    """assign [B, T, K] for positions first_position.. ; rows of sink positions become all ones."""
    sinks = sink_tokens - first_position
    if sinks <= 0:
        return assign
    sinks = min(sinks, assign.shape[1])
    return torch.cat([torch.ones_like(assign[:, :sinks]), assign[:, sinks:]], dim=1)


def hard_groups(logits: torch.Tensor, group_bias: torch.Tensor, top_k: int, first_position: int,
                sink_tokens: int) -> torch.Tensor:
    """Top-k group ids [B, T, m] of logits [B, T, K] + group_bias, for positions first_position.. .

    m = top_k, or K when a sink position is among them (sink rows list every group, the other rows pad with -1).
    """
    num_groups = logits.shape[-1]
    ids = torch.topk(logits.float() + group_bias.float(), top_k, dim=-1).indices
    sinks = min(sink_tokens - first_position, logits.shape[1])
    if sinks <= 0 or top_k == num_groups:
        return ids
    padded = torch.cat([ids, ids.new_full((*ids.shape[:2], num_groups - top_k), -1)], dim=-1)
    every_group = torch.arange(num_groups, device=ids.device).expand(ids.shape[0], sinks, num_groups)
    return torch.cat([every_group, padded[:, sinks:]], dim=1)
