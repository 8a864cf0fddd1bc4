"""Activation policies: what a block saves for backward, and that numerics do not change."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from compiletune.compiler.activation import apply_eager_checkpointing, parse_ac
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.errors import UserError
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name
from compiletune.passes.activation_policy import SAVE_OPS, forward_nodes, tag_activation_policy


def tiny_model(layers: int = 2, seed: int = 0):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = layers, 64, 160, 4, 2
    args.vocab_size = 300
    return build_model(args, seed=seed)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (2, 24), generator=g), torch.randint(0, 300, (2, 24), generator=g)


def step(model, head, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = head(model.hidden_states(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compiled_saved(ac: str, backend: str = "aot_eager") -> list[dict]:
    model = tiny_model()
    head = LossHead(model.output)
    opts = CompileOptions(backend=backend, loss="plain", ac=parse_ac(ac), dump=True)
    regions = compile_regions(model, head, opts)
    step(model, head, *batch())
    (record,) = regions.backends["block"].records
    return [r for r in record.saved if not r["is_input"]]  # what the forward computed and kept


def compiled_saved_bytes(ac: str, backend: str = "aot_eager") -> int:
    return sum(r["bytes"] for r in compiled_saved(ac, backend))


def test_saved_bytes_order_none_selective_full_with_budgets_between():
    saved = {ac: compiled_saved_bytes(ac) for ac in ("none", "selective", "full", "budget=0.5")}
    assert saved["none"] > saved["selective"] > saved["full"], saved
    assert saved["full"] <= saved["budget=0.5"] < saved["none"], saved


def test_full_keeps_only_inputs_and_the_rng_state():
    # CPU attention takes a dropout_p, so the partitioner saves the RNG state (a few KB of
    # uint8) to replay it exactly during recomputation; no activation is kept.
    kept = compiled_saved("full")
    assert all(r["dtype"] == "torch.uint8" and r["bytes"] < 16384 for r in kept), kept


@pytest.mark.slow
def test_saved_bytes_order_with_inductor():
    saved = {ac: compiled_saved_bytes(ac, "inductor") for ac in ("none", "selective", "full")}
    assert saved["none"] > saved["selective"] > saved["full"], saved


@pytest.mark.parametrize("ac", ["full", "selective", "budget=0.0", "budget=0.5"])
def test_compiled_policy_keeps_loss_and_grads(ac):
    base = tiny_model(seed=4)
    other = copy.deepcopy(base)
    hb, ho = LossHead(base.output), LossHead(other.output)
    compile_regions(base, hb, CompileOptions(backend="aot_eager", loss="plain"))
    compile_regions(other, ho, CompileOptions(backend="aot_eager", loss="plain", ac=parse_ac(ac)))
    tokens, targets = batch(1)
    lb, gb = step(base, hb, tokens, targets)
    lo, go = step(other, ho, tokens, targets)
    torch.testing.assert_close(lo, lb, rtol=1e-6, atol=0)
    for name in gb:
        torch.testing.assert_close(go[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_eager_checkpointing_keeps_loss_and_grads_and_names(ac):
    base = tiny_model(layers=3, seed=5)
    other = copy.deepcopy(base)
    names = [n for n, _ in other.named_parameters()]
    assert apply_eager_checkpointing(other, parse_ac(ac, every=2)) == 2  # blocks 0 and 2
    assert [n for n, _ in other.named_parameters()] == names  # checkpoints keep their keys
    tokens, targets = batch(2)
    lb, gb = step(base, LossHead(base.output), tokens, targets)
    lo, go = step(other, LossHead(other.output), tokens, targets)
    assert torch.equal(lo, lb)
    for name in gb:
        assert torch.equal(go[name], gb[name]), name


def test_eager_checkpointing_saves_less(monkeypatch):
    import compiletune.compiler.activation as activation

    decisions = []
    original = activation._selective_policy

    def recording_policy(ctx, op, *args, **kwargs):
        decision = original(ctx, op, *args, **kwargs)
        decisions.append((op, decision))
        return decision

    def saved_bytes(ac):
        model = tiny_model(seed=1)
        if ac != "none":
            apply_eager_checkpointing(model, parse_ac(ac))
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        tokens, _ = batch()
        # Outer hooks see what each checkpoint frame keeps: its inputs, not its activations.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.hidden_states(tokens).sum()
        return total

    assert saved_bytes("none") > 4 * saved_bytes("full")
    monkeypatch.setattr(activation, "_selective_policy", recording_policy)
    saved_bytes("selective")
    kept = {op for op, d in decisions if d == CheckpointPolicy.MUST_SAVE}
    dropped = {op for op, d in decisions if d != CheckpointPolicy.MUST_SAVE}
    assert torch.ops.aten.mm.default in kept
    assert any("attention" in str(op) for op in kept), kept
    assert any("rsqrt" in str(op) or "silu" in str(op) for op in dropped), dropped


def test_ac_every_makes_two_regions_each_compiled_once():
    model = tiny_model(layers=4)
    head = LossHead(model.output)
    opts = CompileOptions(backend="aot_eager", loss="plain", ac=parse_ac("full", every=2))
    regions = compile_regions(model, head, opts)
    step(model, head, *batch())
    stats = regions.stats()["regions"]
    assert stats["block"]["compiles"] == 1 and stats["block.no_ac"]["compiles"] == 1


def test_pass_tags_matmuls_and_attention_save_in_selective():
    model = tiny_model(layers=1)
    captured = {}

    def capture_partition(gm, joint_inputs, **kwargs):
        captured["gm"] = copy.deepcopy(gm)
        from torch._functorch.partitioners import default_partition

        return default_partition(gm, joint_inputs, **kwargs)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def run(g, _):
        return make_boxed_func(g.forward)

    block = model.layers[0]
    block.compile(
        backend=aot_autograd(fw_compiler=run, bw_compiler=run, partition_fn=capture_partition)
    )
    x = torch.randn(2, 8, 64, requires_grad=True)
    block(x, torch.ones(1, 8, 16), torch.zeros(1, 8, 16)).sum().backward()
    gm, stats = tag_activation_policy(captured["gm"], "selective")
    fwd = forward_nodes(gm)
    saved = [n for n in fwd if n.meta["recompute"] == CheckpointPolicy.MUST_SAVE]
    assert {n.target for n in saved if n.target in SAVE_OPS} >= {torch.ops.aten.mm.default}
    assert stats["tagged_save"] == len(saved) and stats["matched"] == len(fwd)
    assert any("attention" in str(n.target) for n in saved)
    _, full = tag_activation_policy(gm, "full")
    assert full["tagged_save"] == 0
    assert all(n.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE for n in fwd)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_selective_saves_the_float8_scales_and_recomputes_the_casts(recipe):
    """--fp8 under --ac selective: the casts' absolute maxima (the reductions over the whole
    operand) and the matmul are saved; the casts themselves (elementwise) are recomputed."""
    pytest.importorskip("torchao")
    from torch.fx.experimental.proxy_tensor import make_fx

    from compiletune import fp8

    matmul = fp8.FrozenFloat8(fp8.config(recipe, emulate=True, fsdp=False))
    gm = make_fx(matmul)(torch.randn(16, 128), torch.randn(64, 128))
    gm, _ = tag_activation_policy(gm, "selective")
    policy = {}
    for n in forward_nodes(gm):
        policy.setdefault(n.target, set()).add(n.meta["recompute"])
    aten = torch.ops.aten
    amax = aten.max.default if recipe == "tensorwise" else aten.amax.default
    assert policy[amax] == policy[aten.mm.default] == {CheckpointPolicy.MUST_SAVE}
    for cast in (aten.abs.default, aten.clamp.default, aten._to_copy.default):
        assert policy[cast] == {CheckpointPolicy.PREFER_RECOMPUTE}, cast
    assert aten._scaled_mm.default in SAVE_OPS  # the float8 matmul on a GPU


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"ac": "budget=2"}, "in \\[0, 1\\]"),
        ({"ac": "some"}, "none, full, selective or budget=F"),
        ({"ac": "budget=0.5"}, "add --compile"),
        ({"ac": "full", "ac_every": 0}, "--ac-every"),
    ],
)
def test_bad_ac_flags(values, needle):
    with pytest.raises(UserError, match=needle):
        resolve({}, values)


# --- --offload-activations -------------------------------------------------------------------


def _count(gm_text: str, op: str) -> int:
    return gm_text.count(f"torch.ops.compiletune.{op}.default(")


@pytest.mark.parametrize(
    "backend, ac",
    [
        ("aot_eager", "none"),
        ("aot_eager", "selective"),
        ("aot_eager", "full"),
        pytest.param("inductor", "none", marks=pytest.mark.slow),
    ],
)
def test_offload_moves_every_saved_activation_and_keeps_numerics(backend, ac, tmp_path):
    base = tiny_model(seed=6)
    other = copy.deepcopy(base)
    hb, ho = LossHead(base.output), LossHead(other.output)
    compile_regions(base, hb, CompileOptions(backend=backend, loss="plain", ac=parse_ac(ac)))
    opts = CompileOptions(
        backend=backend, loss="plain", ac=parse_ac(ac), offload_blocks=len(other.layers), dump=True
    )
    regions = compile_regions(other, ho, opts)
    tokens, targets = batch(3)
    lb, gb = step(base, hb, tokens, targets)
    lo, go = step(other, ho, tokens, targets)
    torch.testing.assert_close(lo, lb, rtol=1e-6, atol=0)
    for name in gb:
        torch.testing.assert_close(go[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)

    summary = regions.write_dump(tmp_path)
    block = summary["block"]
    floats = [r for r in block["saved"] if not r["is_input"] and "float" in r["dtype"]]
    (offload,) = [p for p in block["passes"] if p["pass"] == "offload_activations"]
    # the block's input (the hidden state [b, s, d]) too, where the backward keeps it; under
    # --ac full it is all that is saved
    hidden = tokens.numel() * base.args.dim * 4
    inputs = [r for r in block["saved"] if r["is_input"] and r["bytes"] == hidden]
    assert offload["inputs"] == len(inputs) <= 1 and (ac != "full" or (inputs and not floats))
    assert offload["matched"] == len(floats) + len(inputs) > 0
    assert block["offloaded_bytes"] == sum(r["bytes"] for r in floats + inputs)
    assert 0 <= block["saved_activation_bytes_on_device"] < 16384  # only the uint8 RNG state
    assert block["offloaded_input_bytes"] == sum(r["bytes"] for r in inputs)
    stages = sorted(p.name for p in (tmp_path / "block").iterdir())
    fw = next(s for s in stages if s.endswith("forward.offload_activations.txt"))
    bw = next(s for s in stages if s.endswith("backward.offload_activations.txt"))
    assert _count((tmp_path / "block" / fw).read_text(), "offload_to_host") == offload["matched"]
    assert _count((tmp_path / "block" / bw).read_text(), "reload_from_host") == offload["matched"]
    # The loss head is excluded.
    assert all(p["pass"] != "offload_activations" for p in summary["head"]["passes"])


def test_offload_needs_compile():
    with pytest.raises(UserError, match="add --compile"):
        resolve({}, {"offload_activations": True})


def test_offload_ops_pass_opcheck_and_keep_strides():
    import compiletune.ops.host_copy  # noqa: F401

    x = torch.randn(4, 6, 5).transpose(1, 2)  # non-contiguous but dense
    torch.library.opcheck(torch.ops.compiletune.offload_to_host.default, (x,))
    host = torch.ops.compiletune.offload_to_host(x)
    torch.library.opcheck(
        torch.ops.compiletune.reload_from_host.default, (host, torch.device("cpu"))
    )
    back = torch.ops.compiletune.reload_from_host(host, torch.device("cpu"))
    assert back.stride() == x.stride() and torch.equal(back, x)


def _doc_ids(seed: int) -> torch.Tensor:
    """[2, 24] packed rows: documents of random lengths, numbered 0, 1, 2 ... per row."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(2, 24, generator=g) < 0.2
    starts[:, 0] = True
    return (torch.cumsum(starts.int(), dim=1) - 1).to(torch.int32)


@pytest.mark.parametrize("ac", ["selective", "full", "offload"])
def test_flex_attention_under_compiled_policies(monkeypatch, ac):
    """The CUDA attention kernel (FlexAttention, one block mask per forward built outside the
    blocks) under each compiled policy and offload: loss and gradients equal the eager segment
    op's; selective saves FlexAttention's output (its backward graph runs no attention forward)
    and full recomputes it. Run on CPU through aot_eager, where FlexAttention's dense reference
    has a backward (its Python API refuses CPU gradients, so that check is lifted here); the
    GPU check runs the Triton kernels (tests/gpu/test_cuda.py)."""
    import torch.nn.attention.flex_attention as flex

    from compiletune.models import attention as attn

    monkeypatch.setattr(flex, "_validate_device", lambda *a, **k: None)
    base = tiny_model(seed=6)
    other = copy.deepcopy(base)
    hb, ho = LossHead(base.output), LossHead(other.output)
    policy = parse_ac("none" if ac == "offload" else ac)
    opts = CompileOptions(backend="aot_eager", loss="plain", ac=policy, dump=True)
    opts.offload = ac == "offload"
    monkeypatch.setenv(attn.BACKEND_ENV, "flex")
    regions = compile_regions(other, ho, opts)

    def run(model, head, seed):
        tokens, targets = batch(seed)
        positions = torch.arange(24).expand(2, 24)
        model.zero_grad(set_to_none=True)
        loss = head(model.hidden_states(tokens, positions, _doc_ids(seed)), targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for seed in (1, 2):  # new document boundaries: new block masks, the same graph
        lo, go = run(other, ho, seed)
        monkeypatch.setenv(attn.BACKEND_ENV, "segments")
        lb, gb = run(base, hb, seed)
        monkeypatch.setenv(attn.BACKEND_ENV, "flex")
        torch.testing.assert_close(lo, lb, rtol=1e-5, atol=1e-6)
        for name in gb:
            torch.testing.assert_close(go[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)
    (record,) = regions.backends["block"].records  # one compile for both batches
    stages = {s.name: s.counts for s in record.stages}
    assert stages["forward"]["torch.ops.higher_order.flex_attention"] == 1
    assert stages["backward"]["torch.ops.higher_order.flex_attention_backward"] == 1
    recomputed = stages["backward"]["torch.ops.higher_order.flex_attention"]
    assert recomputed == (1 if ac == "full" else 0), stages["backward"]
    # the mask is built outside the block: its graph holds no mask-building work
    assert not any("sort" in op or "cumsum" in op for op in stages["dynamo"]), stages["dynamo"]
