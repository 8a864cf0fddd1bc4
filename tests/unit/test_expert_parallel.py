"""Expert parallelism (`--ep`): experts split across ranks, tokens exchanged with all_to_all.

Two gloo ranks, --ep 2, tiny models of four MoE families built from transformers configs in
the test: each rank trains its own rows as the trainer does (loss scaled by the world, FSDP2 on
the non-expert weights), and the loss and every gradient equal one process that runs both
ranks' rows (rel 1e-5, fp32), full fine-tune and LoRA on the experts; a routing that sends
nothing to one rank's experts; the bias update of DeepSeek-V3's router from global loads. One
spawn serves every family (starting ranks is the costly part on a 2-core machine).
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from gloo import free_port

from compiletune.distributed import apply_fsdp, close_group
from compiletune.errors import UserError
from compiletune.expert_parallel import apply_expert_parallel, check_ep
from compiletune.models import args_from_hf_config, build_model
from compiletune.models.lora import LoRASpec, apply_lora
from compiletune.models.moe import MoE, router_losses, update_score_bias

VOCAB = 64
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES = {
    # softmax top-2 of 6 experts, renormalised; layer 1 dense
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(SMALL, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16)
        | dict(num_experts=6, norm_topk_prob=True, mlp_only_layers=[1], head_dim=8),
    ),
    # sigmoid router with a correction bias over 2 of 4 groups, a shared expert, routed
    # scaling, MLA, one dense layer first
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(SMALL, num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=16)
        | dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        | dict(n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1)
        | dict(n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5),
    ),
    # expert and router biases, SwiGLU clamped at 0.5 (small: it bites), sinks, windows
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(SMALL, num_hidden_layers=2, head_dim=8, sliding_window=8, intermediate_size=16)
        | dict(num_local_experts=8, swiglu_limit=0.5),
    ),
    # the DeepSeek-V3 router without groups on GQA with biases, a shared expert, a dense layer
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        dict(SMALL, num_hidden_layers=2, head_dim=8, attention_bias=True, use_qk_norm=True)
        | dict(n_routed_experts=8, first_k_dense_replace=1, n_shared_experts=1)
        | dict(moe_intermediate_size=16, routed_scaling_factor=1.5, intermediate_size=48),
    ),
}
WORLD, ROWS, SEQ, AUX = 2, 2, 12, 0.05


def make_model(case: str, lora: bool) -> torch.nn.Module:
    config_cls, kwargs = CASES[case]
    args = args_from_hf_config(config_cls(**kwargs).to_dict())
    model = build_model(args, seed=0)
    with torch.no_grad():  # routers that prefer some experts; biases and norms not trivial
        for name, p in model.named_parameters():
            if "router" in name or "norm" in name or name.endswith(("b13", "b2", "bias")):
                p.add_(0.3 * torch.randn_like(p))
    if lora:
        apply_lora(
            model, LoRASpec(rank=2, alpha=4.0, targets=("gate", "up", "down")), dtype=torch.float32
        )
        with torch.no_grad():  # B starts at zero, which would leave A's gradient zero
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0.0, 0.1)
    return model


def local_objective(model, t: torch.Tensor, n_targets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(what one rank back-propagates, its CE sum): the trainer's scaling (step.py): CE sum x
    world / global targets, plus the load-balancing loss of its own rows."""
    stats: list[torch.Tensor] = []
    logits = model.logits(model.hidden_states(t[:, :-1], router_stats=stats))
    ce = F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten(), reduction="sum")
    aux, _ = router_losses(stats, model.args.n_experts)
    return ce * (WORLD / n_targets) + AUX * aux, ce


def compare(case: str, lora: bool, skew: bool) -> dict[str, float]:
    """Relative errors (name -> error) of the loss and every gradient on this rank, under
    --ep 2 against one process running both ranks' rows."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = make_model(case, lora)
    if skew:  # the sigmoid routers' bias sends every token to rank 0's experts
        for m in ref.modules():
            if isinstance(m, MoE):
                m.score_bias.data[m.n_experts // 2 :] = -100.0
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(3, VOCAB, (WORLD * ROWS, SEQ), generator=g)
    n_targets = batch[:, 1:].numel()
    ref_ce = torch.zeros(())
    for r in range(WORLD):  # the reference: each rank's rows, FSDP's mean over ranks
        obj, ce = local_objective(ref, batch[r * ROWS : (r + 1) * ROWS], n_targets)
        (obj / WORLD).backward()
        ref_ce += ce.detach()

    ep = apply_expert_parallel(model, 2, "cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", (WORLD,), mesh_dim_names=("shard",)
    )
    apply_fsdp(model, mesh)
    obj, ce = local_objective(model, batch[rank * ROWS : (rank + 1) * ROWS], n_targets)
    obj.backward()
    ep.finish_grads()
    dist.all_reduce(ce := ce.detach())
    errors = {"loss": rel(ce / n_targets, ref_ce / n_targets)}
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        expected = want[name].grad
        if name in ep.names:
            expected = expected[ep.names[name]]
            got = p.grad
        else:
            got = p.grad.full_tensor()
        errors[name] = rel(got, expected)
    if skew:  # rank 1's experts got nothing: zero gradients there, and the reference agrees
        errors["skew_rank1_idle"] = float(
            rank == 1 and any(p.grad.abs().sum() > 0 for p in ep.params)
        )
    return errors


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.abs().max() == 0:
        return float(a.abs().max())
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bias_update_is_global() -> dict[str, float]:
    """DeepSeek-V3's bias update under --ep 2 from loads all-reduced over ranks equals one
    process's from the loads of both ranks' rows."""
    torch.manual_seed(0)
    ref = make_model("deepseek_v3", lora=False)
    model = copy.deepcopy(ref)
    rank = dist.get_rank()
    batch = torch.randint(3, VOCAB, (WORLD * ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    stats: list[torch.Tensor] = []
    with torch.no_grad():
        ref.hidden_states(batch[:, :-1], router_stats=stats)
    e = ref.args.n_experts
    update_score_bias(ref, torch.stack([s[:e] for s in stats]), 1e-2)
    apply_expert_parallel(model, 2, "cpu")
    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", (WORLD,), mesh_dim_names=("shard",)
    )
    apply_fsdp(model, mesh)
    stats = []
    with torch.no_grad():
        model.hidden_states(batch[rank * ROWS : (rank + 1) * ROWS, :-1], router_stats=stats)
    loads = torch.stack([s[:e] for s in stats])
    dist.all_reduce(loads)  # what step.py does before the update
    update_score_bias(model, loads, 1e-2)
    want = [m.score_bias for m in ref.modules() if isinstance(m, MoE)]
    got = [m.score_bias.full_tensor() for m in model.modules() if isinstance(m, MoE)]
    moved = max(float(w.abs().max()) for w in want)
    return {"bias": max(rel(a, b) for a, b in zip(got, want, strict=True)), "moved": moved}


def worker(rank: int, port: int, out: str, jobs: list[tuple[str, bool, bool]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a failed rank must not leave the other waiting for gloo's 30-minute default
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    results = {}
    try:
        for case, lora, skew in jobs:
            results[f"{case} lora={lora} skew={skew}"] = compare(case, lora, skew)
        results["bias update"] = bias_update_is_global()
        dist.barrier()
    finally:
        close_group()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(results, f)


def run_ranks(tmp_path, jobs: list[tuple[str, bool, bool]]) -> list[dict]:
    out = str(tmp_path / "results")
    mp.spawn(worker, args=(free_port(), out, jobs), nprocs=WORLD, join=True)
    return [pickle.load(open(f"{out}.{r}", "rb")) for r in range(WORLD)]


@pytest.mark.slow
def test_ep2_losses_and_gradients_equal_one_process(tmp_path):
    jobs = [(case, lora, False) for case in CASES for lora in (False, True)]
    jobs.append(("deepseek_v3", False, True))  # one rank's experts get no tokens
    per_rank = run_ranks(tmp_path, jobs)
    for rank, results in enumerate(per_rank):
        for job, errors in results.items():
            if job == "bias update":
                assert errors["bias"] <= 1e-6 and errors["moved"] > 0, (rank, errors)
                continue
            assert len(errors) > 3, (rank, job)  # gradients were compared, not just the loss
            bad = {k: v for k, v in errors.items() if not v <= 1e-5}
            assert not bad, f"rank {rank}, {job}: {bad}"


@pytest.mark.parametrize(
    "ep,world,experts,says",
    [
        (2, 2, 0, "has none; drop --ep"),
        (3, 4, 6, "does not divide the 4 processes"),
        (4, 4, 6, "does not divide the model's 6 experts"),
    ],
)
def test_bad_ep_is_one_line_naming_the_fix(ep, world, experts, says):
    with pytest.raises(UserError, match=says):
        check_ep(ep, world, experts)
    check_ep(2, 4, 6)  # fine
