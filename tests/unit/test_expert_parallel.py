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
import json
import os
import pickle
from pathlib import Path

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


def sharded_round_trip(folder: str) -> dict[str, float]:
    """A sharded checkpoint of an --ep model holds every expert once, whole (read back without
    a process group), and loads into another --ep model exactly."""
    from compiletune.distributed import load_sharded, read_sharded_tensor, save_sharded

    torch.manual_seed(0)
    ref = make_model("gpt_oss", lora=False)
    models = []
    for seed in (0, 1):  # the saved model, and one with other weights to load into
        torch.manual_seed(seed)
        m = make_model("gpt_oss", lora=False)
        ep = apply_expert_parallel(m, 2, "cpu")
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", (WORLD,), mesh_dim_names=("shard",)
        )
        apply_fsdp(m, mesh)
        models.append((m, ep))
    save_sharded(Path(folder), models[0][0], {})
    dist.barrier()
    model, ep = models[1]
    load_sharded(Path(folder), model, {})
    want = dict(ref.named_parameters())
    errors = {}
    for name, p in model.named_parameters():
        got = p.detach() if name in ep.names else p.full_tensor()
        expected = want[name].detach()[ep.names[name]] if name in ep.names else want[name]
        errors[name] = rel(got, expected)
    for name in ep.names:  # whole in the files: E experts, this process alone reads them
        whole = read_sharded_tensor(Path(folder), name, tuple(want[name].shape), torch.float32)
        errors[f"whole {name}"] = rel(whole, want[name].detach())
    return errors


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
        results["sharded checkpoint"] = sharded_round_trip(f"{out}-sharded")
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


@pytest.mark.parametrize(
    "flags,says",
    [
        ({"ep": 0}, "--ep must be a positive process count"),
        ({"ep": 2}, "add --fsdp"),
        ({"ep": 2, "fsdp": True, "cpu_offload": True}, "--ep with --cpu-offload"),
        ({"ep": 2, "fsdp": True, "dtype": "bf16-mixed"}, "--ep with --dtype bf16-mixed"),
    ],
)
def test_bad_ep_flags_are_one_line(flags, says):
    from compiletune.config import resolve

    with pytest.raises(UserError, match=says):
        resolve({}, {"model": "debug_moe", **flags})


# ----------------------------------------------------------------------------- the trainer

TEXT = "\n".join(f"Row {i}: a line about experts, number {i * 11 % 17}." for i in range(200))
BASE = {"seq_len": 32, "batch_size": 2, "max_steps": 2, "n_layers": 2, "lr": 3e-3}
BASE |= {"model": "debug_moe", "router_aux_coef": 0.1, "packing": "stream"}
# name -> flags of both runs (the 2-rank one adds --fsdp --ep 2). The reference runs the two
# ranks' rows as two accumulated micro-batches: the load-balancing loss is each rank's own, as
# under FSDP alone. Stepping in backward takes no accumulation: no load-balancing loss there.
TRAINER_CASES = {
    "compiled-selective-lora": {"compile": True, "compile_backend": "aot_eager"}
    | {"ac": "selective", "lora_rank": 4, "lora_targets": "q,v,gate,up,down"},
    "in-backward-8bit": {"optimizer_in_backward": True, "max_grad_norm": 0.0}
    | {"optimizer": "adamw8bit", "router_aux_coef": 0.0},
    # sigmoid router, groups, shared expert, a dense first layer; the bias nudged by the loads
    # of both ranks' rows
    "deepseek-bias-update": {"model": "debug_deepseek", "router_bias_update_rate": 1e-2},
    # QLoRA: each rank keeps its experts' NF4 codes and scales (rows of the whole model's)
    "qlora": {"lora_rank": 4, "lora_targets": "q,v,gate,up,down", "quantize_base": "nf4"},
}


def trainer_worker(rank: int, port: int, tmp: str) -> None:
    from compiletune.config import resolve
    from compiletune.train.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        for name, flags in TRAINER_CASES.items():
            values = {**BASE, **flags, "data": f"{tmp}/corpus.txt", "fsdp": True, "ep": 2}
            train(resolve({}, {**values, "output_dir": f"{tmp}/{name}"}))
            torch.compiler.reset()
        dist.barrier()
    finally:
        close_group()


def exported(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in a checkpoint folder."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def losses(folder) -> list[float]:
    from compiletune.metrics import read_metrics

    return [r["loss"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_trainer_ep2_matches_one_process(tmp_path):
    """`train --fsdp --ep 2` on 2 ranks (compiled with an activation policy and LoRA on the
    experts; 8-bit AdamW stepping in backward; DeepSeek's router with its bias update, eager,
    clipped; QLoRA with NF4 experts) against one process with the whole batch: the second
    step's loss shows the first update."""
    from compiletune.config import resolve
    from compiletune.train.loop import train

    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(trainer_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    failures = []
    for name, flags in TRAINER_CASES.items():
        out = tmp_path / f"ref-{name}"
        values = {**BASE, **flags, "data": str(tmp_path / "corpus.txt")}
        if not flags.get("optimizer_in_backward"):
            values["grad_accum"] = 2
        else:
            values["batch_size"] = 4
        train(resolve({}, {**values, "output_dir": str(out)}))
        want, got = losses(out), losses(tmp_path / name)
        if len(got) != 2 or got != pytest.approx(want, rel=1e-5):
            failures.append(f"{name}: {got} vs one process {want}")
    assert not failures, "\n".join(failures)
    # the final checkpoint gathers the experts: the HF weights of a full fine-tune and the
    # adapter folder of a LoRA run are one process's
    for name in ("deepseek-bias-update", "compiled-selective-lora", "qlora"):
        got, want = (
            exported(tmp_path / name / "step_2"),
            exported(tmp_path / f"ref-{name}" / "step_2"),
        )
        assert got.keys() == want.keys() and any("experts" in k for k in got), name
        bad = {k: rel(got[k], want[k]) for k in got if not rel(got[k], want[k]) <= 1e-4}
        assert not bad, (name, bad)
    summary = json.loads((tmp_path / "compiled-selective-lora" / "summary.json").read_text())
    assert summary["compile"]["recompiles"] == 0 and summary["processes"] == 2, summary


# ----------------------------------------------------------------------------- resume under another --ep

RESUME = BASE | {"max_steps": 4, "save_every": 2, "fsdp": True}
# name -> (--ep of the straight run, --ep of the resume, flags); 4 ranks: test_expert_parallel_4ranks
RESUME_CASES = {
    "full-1-to-2": (1, 2, {}),
    "lora-2-to-1": (2, 1, {"lora_rank": 4, "lora_targets": "q,v,gate,up,down"}),
}


def resume_worker(rank: int, port: int, tmp: str) -> None:
    """Per case: the straight 4-step run (checkpoints at 2 and 4), then a copy of it cut back
    to step 2 resumed to step 4 under the other --ep."""
    import shutil

    from compiletune.config import resolve
    from compiletune.train.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        for name, (ep, other, flags) in RESUME_CASES.items():
            values = {**RESUME, **flags, "data": f"{tmp}/corpus.txt"}
            straight, resumed = f"{tmp}/{name}", f"{tmp}/{name}-resumed"
            train(resolve({}, {**values, "ep": ep, "output_dir": straight}))
            if rank == 0:
                shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_4"))
            dist.barrier()
            train(resolve({}, {**values, "ep": other, "output_dir": resumed, "resume": True}))
        dist.barrier()
    finally:
        close_group()


def losses_by_step(folder) -> dict[int, float]:
    from compiletune.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
def test_resume_under_another_ep_equals_the_straight_run(tmp_path):
    """A sharded checkpoint of `--fsdp` alone (--ep 1) resumed under `--fsdp --ep 2` on the same
    2 ranks, and of a LoRA run on the experts under --ep 2 resumed under --ep 1: steps 3 and 4
    equal the straight run's (the weights or adapters, AdamW's moments, the data position and
    the RNG all came back). On 2 ranks FSDP's rows of an expert weight are --ep 2's;
    test_expert_parallel_4ranks.py resumes where they differ."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(resume_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for name in RESUME_CASES:
        want = losses_by_step(tmp_path / name)
        got = losses_by_step(tmp_path / f"{name}-resumed")
        assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [1, 2, 3, 4], (name, want, got)
        assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-5)
        assert want[4] != pytest.approx(want[2], rel=1e-3)  # the steps moved the weights


def test_resume_under_another_ep_refuses_8bit_adamw():
    from compiletune.config import resolve
    from compiletune.train.run_dir.resume import check_ep_change

    cfg = resolve({}, {**RESUME, "ep": 1, "optimizer": "adamw8bit"})
    with pytest.raises(UserError, match=r"--ep 2 -> 1: 8-bit AdamW .* resume with --ep 2$"):
        check_ep_change(cfg, {"ep": 2, "optimizer": "adamw8bit"})
    check_ep_change(cfg, {"ep": 1})  # the same --ep: fine
