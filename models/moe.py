"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, Qwen3.5-MoE, gpt-oss, DeepSeek-V3,
GLM-4.5): a router picks `top_k` of `n_experts` SwiGLU experts per token, and the chosen experts'
outputs are summed with the router's weights; Qwen3.5-MoE and DeepSeek-V3 add a shared expert
every token goes through (Qwen's gated per token).

    logits = x Wr^T                       [t, E]   (t = b * s tokens)
    probs  = softmax(fp32 logits)         [t, E]
    w, idx = top_k(probs)                 [t, k]   renormalised to sum 1 when `norm_topk`
    y_t    = sum_j w_tj * expert_idx_tj(x_t)

DeepSeek-V3's router ("sigmoid") scores each expert by sigmoid(logit), picks the top k of
score + a correction bias (within the best `topk_groups` of `n_groups` expert groups) and weighs
them by their scores (renormalised), times `routed_scale`. The bias only steers the choice; the
trainer can nudge it towards balanced loads after each step (`update_score_bias`).

Compute is grouped, not looped: the t*k (token, expert) pairs are sorted by expert, the tokens
gathered into one [t*k, d] matrix in that order, and each projection of every expert runs as
one grouped matmul over it (`compiletune.ops.grouped_mm`). How many rows each expert gets is
data (`offs`), never a shape, so a compiled block compiles once whatever the routing.

Expert weights are stacked, in the HF Linear layout per expert ([out, in]):
    experts.w13  [E, 2F, d]  gate rows then up rows (HF gate_proj / up_proj, Mixtral w1 / w3)
    experts.w2   [E, d, F]   down (HF down_proj, Mixtral w2)
`hf.py` maps them to and from the hub's one-tensor-per-expert checkpoints.

Every MoE block also returns its router statistics (`ROUTER_STATS` columns, fp32): tokens
routed to each expert (no gradient), the router probabilities summed over tokens, the sum of
squared log-sum-exps of the logits and the token count. `router_losses` turns the statistics of
all layers into transformers' load-balancing loss and the router z-loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.ops.grouped_mm import grouped_mm


def glu(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """act(gate) * up, act = silu (SwiGLU) or tanh-GELU (GeGLU)."""
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def clamped_glu(gate: Tensor, up: Tensor, limit: float, alpha: float) -> Tensor:
    """gpt-oss's SwiGLU: gate clamped above at `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


class Experts(nn.Module):
    """`n_experts` SwiGLU MLPs as two stacked weights (see the module docstring)."""

    def __init__(
        self,
        n_experts: int,
        dim: int,
        ffn_dim: int,
        activation: str = "silu",
        bias: bool = False,
        clamp: float = 0.0,
        alpha: float = 1.702,
    ) -> None:
        super().__init__()
        self.n_experts, self.dim, self.ffn_dim = n_experts, dim, ffn_dim
        self.activation = activation  # "silu" (SwiGLU) or "gelu_tanh" (Gemma 4's GeGLU)
        # gpt-oss: biases on both projections, and its clamped SwiGLU (`clamped_glu`)
        self.clamp, self.alpha = clamp, alpha
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.b13 = nn.Parameter(torch.zeros(n_experts, 2 * ffn_dim)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n_experts, dim)) if bias else None

    def project(self, name: str, x: Tensor, offs: Tensor) -> Tensor:
        """Rows of x [n, in] grouped by expert times weight `name` ("w13" | "w2") transposed.
        (LoRA's experts, models/lora.py, override this and keep `forward`.)"""
        return grouped_mm(x, getattr(self, name).transpose(-2, -1), offs)

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        """x [n, d] grouped by expert (offs [E] int32: cumulative rows) -> [n, d]."""
        h = self.project("w13", x, offs)
        expert = None
        if self.b13 is not None:  # each row's expert, from the cumulative counts
            rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
            expert = torch.searchsorted(offs, rows, right=True).clamp_max(self.n_experts - 1)
            h = h + self.b13[expert].to(h.dtype)
        gate, up = h.chunk(2, dim=-1)
        if self.clamp:
            y = self.project("w2", clamped_glu(gate, up, self.clamp, self.alpha), offs)
        else:
            y = self.project("w2", glu(gate, up, self.activation), offs)
        return y if expert is None else y + self.b2[expert].to(y.dtype)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, dim={self.dim}, ffn_dim={self.ffn_dim}"


# Columns of a block's router statistics, each [E] or [1], concatenated into one fp32 vector.
ROUTER_STATS = ("tokens", "prob_sum", "z_sum", "n")


class SharedExpert(nn.Module):
    """The SwiGLU MLP every token goes through beside its routed experts (Qwen3.5-MoE), times
    sigmoid(x . gate) when the family gates it: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int, gated: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.gate = nn.Linear(dim, 1, bias=False) if gated else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out


class MoE(nn.Module):
    """Router + experts (+ a shared expert); `forward(x)` -> (y, router statistics)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        norm_topk: bool,
        shared_ffn_dim: int = 0,
        shared_gate: bool = False,
        activation: str = "silu",
        router_norm_eps: float = 0.0,
        bias: bool = False,
        clamp: float = 0.0,
        alpha: float = 1.702,
        score: str = "softmax",
        n_groups: int = 1,
        topk_groups: int = 1,
        routed_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be in 1..n_experts ({n_experts})")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown router score {score!r}; expected softmax or sigmoid")
        if n_experts % n_groups or not 0 < topk_groups <= n_groups:
            raise ValueError(
                f"{n_experts} experts in {n_groups} groups, {topk_groups} of them picked: the "
                "groups must divide the experts and the picked groups be 1..groups"
            )
        if n_groups > 1 and (
            n_experts // n_groups < 2 or topk_groups * n_experts < top_k * n_groups
        ):
            raise ValueError("each group needs 2+ experts and the picked groups top_k of them")
        self.n_experts, self.top_k, self.norm_topk = n_experts, top_k, norm_topk
        # DeepSeek-V3 / GLM-4.5: sigmoid scores; a correction bias (frozen; nudged by the
        # trainer's --router-bias-update-rate) added only to pick experts, among the
        # `topk_groups` groups of experts whose two best scores sum highest
        self.score, self.n_groups, self.topk_groups = score, n_groups, topk_groups
        self.routed_scale = routed_scale
        self.score_bias = (
            nn.Parameter(torch.zeros(n_experts), requires_grad=False)
            if score == "sigmoid"
            else None
        )
        # gpt-oss: the router and the experts have biases
        self.router = nn.Linear(dim, n_experts, bias=bias)
        self.experts = Experts(n_experts, dim, ffn_dim, activation, bias, clamp, alpha)
        self.shared = SharedExpert(dim, shared_ffn_dim, shared_gate) if shared_ffn_dim else None
        # Gemma 4's router: its input RMS-normed (no weight), times a learned scale and d**-0.5;
        # the chosen experts' weights times a learned scale per expert
        self.router_norm_eps = router_norm_eps
        self.router_scale = nn.Parameter(torch.ones(dim)) if router_norm_eps else None
        self.expert_scale = nn.Parameter(torch.ones(n_experts)) if router_norm_eps else None
        # Expert parallelism, set from outside (compiletune.distributed.apply_expert_parallel):
        # a callable (experts, rows [t*k, d] grouped by expert, counts [E]) -> [t*k, d] that
        # runs each row on the rank holding its expert (`self.experts` then holds E/N of them)
        self.exchange: Callable[[nn.Module, Tensor, Tensor], Tensor] | None = None

    def reset_parameters(self) -> None:
        """The router's scales start at one, the correction bias at zero (the weights are drawn
        by `init_weights`)."""
        for p in (self.router_scale, self.expert_scale):
            if p is not None:
                nn.init.ones_(p)
        if self.score_bias is not None:
            nn.init.zeros_(self.score_bias)

    def _sigmoid_route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """DeepSeek-V3's router, in fp32: (logits, per-token score shares [t, E], weights [t, k],
        experts [t, k])."""
        bias = self.router.bias
        logits = F.linear(
            x.float(), self.router.weight.float(), None if bias is None else bias.float()
        )
        scores = torch.sigmoid(logits)
        choice = scores + self.score_bias.float()
        if self.n_groups > 1:
            t, g = choice.shape[0], self.n_groups
            best = choice.view(t, g, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [t, groups]
            picked = torch.topk(best, self.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, picked, True)
            keep = keep[:, :, None].expand(t, g, self.n_experts // g).reshape(t, -1)
            choice = choice.masked_fill(~keep, float("-inf"))
        chosen = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, scores / scores.sum(dim=-1, keepdim=True), weights, chosen

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """flat [t, d] -> (weights [t, k] in x's dtype, experts [t, k], stats [2E + 2] fp32)."""
        x = flat
        if self.router_scale is not None:
            y = flat.float()
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.router_norm_eps)).to(
                x.dtype
            )
            x = y * self.router_scale * flat.shape[-1] ** -0.5
        if self.score == "sigmoid":
            logits, probs, weights, chosen = self._sigmoid_route(x)
        else:
            logits = self.router(x).float()  # [t, E]
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]
        tokens = torch.zeros(self.n_experts, dtype=torch.float32, device=flat.device)
        tokens = tokens.scatter_add(
            0, chosen.flatten(), torch.ones_like(chosen.flatten(), dtype=torch.float32)
        )
        z_sum = torch.logsumexp(logits, dim=-1).square().sum()
        n = torch.full((1,), float(flat.shape[0]), device=flat.device)
        stats = torch.cat([tokens.detach(), probs.sum(dim=0), z_sum[None], n])
        return weights.to(flat.dtype), chosen, stats

    def forward(self, x: Tensor, route_from: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [b, s, d] -> (y [b, s, d], router stats [2E + 2] fp32); the router reads
        `route_from` [b, s, d] instead of x when given (Gemma 4)."""
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        weights, chosen, stats = self.route(
            flat if route_from is None else route_from.reshape(-1, d)
        )
        flat_chosen = chosen.flatten()  # [t*k], pair j is token j // k
        order = torch.argsort(flat_chosen, stable=True)  # pairs grouped by expert
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat_chosen, torch.ones_like(flat_chosen))
        offs = counts.cumsum(0).to(torch.int32)
        token = order // self.top_k
        if self.exchange is None:
            out = self.experts(flat[token], offs)  # [t*k, d]
        else:  # expert parallel: the experts of this layer are spread over ranks
            out = self.exchange(self.experts, flat[token], counts)
        out = out * weights.flatten()[order, None]
        y = torch.zeros_like(flat).index_add(0, token, out)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(b, s, d), stats


def split_stats(stats: Tensor, n_experts: int) -> dict[str, Tensor]:
    """A (sum of) router statistics vector -> its named columns (see `ROUTER_STATS`)."""
    e = n_experts
    return {
        "tokens": stats[:e],
        "prob_sum": stats[e : 2 * e],
        "z_sum": stats[2 * e],
        "n": stats[-1],
    }


def router_losses(stats: list[Tensor], n_experts: int) -> tuple[Tensor, Tensor]:
    """(load-balancing loss, z-loss) over the router statistics of every MoE layer of one
    forward.

    Load balancing as transformers computes it over all layers' routing at once (Switch
    Transformer's loss, summed over the top-k slots): with C[e] the (token, slot) pairs routed
    to expert e and P[e] its summed probability, over all layers and the n = layers x tokens
    routings, aux = E * sum_e (C[e] / n) * (P[e] / n); 1.0 when perfectly balanced with k = 1.
    z-loss (ST-MoE): the mean over routings of logsumexp(logits)^2.
    """
    total = split_stats(torch.stack(stats).sum(dim=0), n_experts)
    n = total["n"]
    aux = n_experts * (total["tokens"] * total["prob_sum"]).sum() / (n * n)
    return aux, total["z_sum"] / n


@torch.no_grad()
def update_score_bias(model: nn.Module, expert_tokens: Tensor, rate: float) -> int:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each sigmoid router's
    correction bias moves by `rate` per expert, up where the expert received fewer tokens than
    its layer's mean and down where more (`expert_tokens` [MoE layers, E]: the step's counts,
    every rank's). The bias is kept in fp32 beside the parameter (a bf16 one could not take
    steps of 1e-3) and written back in its dtype; a sharded (FSDP) bias gets its own shard.
    Returns the number of routers updated."""
    routers = [m for m in model.modules() if isinstance(m, MoE)]
    if len(routers) != expert_tokens.shape[0]:
        raise ValueError(f"{expert_tokens.shape[0]} layers of counts for {len(routers)} routers")
    done = 0
    for moe, load in zip(routers, expert_tokens, strict=True):
        bias = moe.score_bias
        if bias is None:
            continue
        full = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
        master = getattr(moe, "_score_bias_fp32", None)
        if master is None:
            master = full.detach().float().clone()
        load = load.to(master.device, torch.float32)
        master += rate * torch.sign(load.mean() - load)
        moe._score_bias_fp32 = master
        value = master.to(bias.dtype)
        if hasattr(bias, "full_tensor"):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, bias.device_mesh, bias.placements)
        bias.copy_(value)
        done += 1
    return done
