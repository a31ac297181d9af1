"""[speculative] groundwork: verifying draft tokens against the target model's distributions, as
speculative sampling does (Leviathan et al. 2023, Chen et al. 2023), so that every emitted token
has exactly the target's distribution, whatever the drafts.

Per sequence, with k draft tokens d_i, the draft's distributions q_i they were drawn from and the
target's p_1 .. p_k+1 (already processed: temperature, top-k, top-p, min-p, penalties, bias): d_i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order; the first rejected one is
replaced by a draw from max(0, p_i - q_i), normalized, and nothing after it is kept; when all k
are accepted, a bonus token is drawn from p_k+1. A draft without distributions (n-gram lookup)
passes q_i one-hot at d_i. Greedy is the same rule on one-hot targets: a draft is accepted exactly
when it is the argmax. Nothing calls it yet.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, k+1, V], draft_probs [B, k, V], draft_tokens [B, k] -> (tokens [B, k+1],
    the emitted tokens with -1 past them; num_emitted [B], from 1 to k+1)."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    uniform = torch.rand((batch, k), generator=generator, device=draft_tokens.device)
    p = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    q = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    accepted = uniform * q < p  # u < p / q without dividing by a zero q (a draft never draws q = 0)
    num_accepted = torch.cumprod(accepted.int(), dim=1).sum(1)  # the leading run
    # the token at position num_accepted: a draw from the residual, or the bonus when all passed
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0)
    position = num_accepted.clamp(max=k - 1) if k else num_accepted
    dist = torch.where((num_accepted == k)[:, None], target_probs[:, k],
                       residual[rows, position] if k else target_probs[:, 0])
    dist = dist / dist.sum(1, keepdim=True)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=draft_tokens.device)
    keep = torch.arange(k, device=draft_tokens.device)[None, :] < num_accepted[:, None]
    tokens[:, :k] = torch.where(keep, draft_tokens, -1)
    tokens[rows, num_accepted] = last
    return tokens, num_accepted + 1
