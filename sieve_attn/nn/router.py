"""The Focus router: a projection W_g and K centroids per attention layer, shared by all heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FocusConfig
from ..ops.focus.routing import causal_log_assign, sinkhorn


class FocusRouter(nn.Module):
    """Scores every token against K centroids: logits = rms_normalize(W_g h) C^T / tau, in float32.

    Normalising the projection makes the logit scale independent of the hidden-state norm, which differs by orders
    of magnitude between models (and between tokens: attention-sink tokens carry huge norms).

    Parameters: ``proj`` (W_g, hidden_size -> group_dim, no bias) and ``centroids`` C [K, group_dim]; that is
    L * (d * d_g + K * d_g) for a model of L layers (148,224 for GPT-2 124M with K=4, d_g=16). The buffer
    ``group_bias`` [K] holds the running average of the Sinkhorn column potentials, used by causal routing.
    """

    def __init__(self, hidden_size: int, config: FocusConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(hidden_size, config.group_dim, bias=False, dtype=torch.float32)
        self.centroids = nn.Parameter(torch.empty(config.num_groups, config.group_dim, dtype=torch.float32))
        self.register_buffer("group_bias", torch.zeros(config.num_groups, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Unit-variance projections against unit-norm centroids give logits of order 1/tau at the start, so
        # Sinkhorn begins from confident but balanced assignments.
        nn.init.normal_(self.proj.weight, std=self.proj.in_features ** -0.5)
        nn.init.normal_(self.centroids)
        with torch.no_grad():
            self.centroids /= self.centroids.norm(dim=-1, keepdim=True)
        self.group_bias.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [B, T, hidden] -> logits [B, T, K], computed in float32 whatever the model's dtype, the
        router's own (a model cast after compose casts it too) or an autocast: at tau = 0.1 bfloat16 logits would
        be off by tenths, enough to swap near-tied groups."""
        with torch.autocast(hidden_states.device.type, enabled=False):
            projected = F.linear(hidden_states.float(), self.proj.weight.float())
            projected = projected * projected.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
            return projected @ self.centroids.float().t() / self.config.tau

    def training_assign(self, logits: torch.Tensor, causal: bool) -> torch.Tensor:
        """Training-time memberships [B, T, K] (rows sum to 1) from logits [B, T, K].

        Sinkhorn runs over the tokens of each sequence either way; in training mode its column potentials update
        ``group_bias``. ``causal=False`` returns Sinkhorn's own memberships (the paper: each depends on the whole
        sequence, gradients through every iteration). ``causal=True`` returns softmax_k(logits + group_bias), the
        routing used at inference, so training sees what evaluation sees and no token's routing depends on a later
        token; balance then comes only through ``group_bias`` following the potentials.
        """
        log_assign, potentials = sinkhorn(logits, self.config.sinkhorn_iters)
        # Activation checkpointing (torch.utils.checkpoint, transformers' gradient_checkpointing_enable, FSDP's
        # checkpoint wrapper) runs this forward again inside backward: the running average must move once per
        # step, and the recomputed causal routing must use the bias the first forward used.
        if self.training and not _recomputing_in_backward():
            with torch.no_grad():
                centred = (potentials - potentials.mean(dim=-1, keepdim=True)).mean(dim=0)
                self.group_bias.mul_(self.config.bias_momentum).add_(centred, alpha=1 - self.config.bias_momentum)
        if causal:
            return causal_log_assign(logits, self.group_bias).exp()
        return log_assign.exp()


def _recomputing_in_backward() -> bool:
    """Whether this forward runs inside the autograd engine's backward, as a checkpointed forward's recomputation
    does (torch.utils.checkpoint itself reads the same graph-task id)."""
    return torch._C._current_graph_task_id() != -1
