"""The benches' bookkeeping on synthetic results: regress.py's comparison, the ladder's skipping
and ratios, the peers' headline ratios. No bench is run here."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(BENCH))  # the benches import their sibling `common`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


regress = _load("regress")
ladder = _load("ladder")
peers = _load("peers")
common = _load("common")
activation = _load("activation")


def ladder_result(**overrides) -> dict:
    rungs = [
        {"rung": "eager", "tokens_per_s": 1000.0, "peak_mem_gib": 4.0, "step_spread": 0.02},
        {"rung": "+ compile", "tokens_per_s": 1500.0, "peak_mem_gib": 3.5, "step_spread": 0.02},
        {"rung": "+ 8-bit AdamW", "skipped": "compiletune train has no --optimizer yet"},
    ]
    for rung, values in overrides.items():
        next(r for r in rungs if r["rung"] == rung).update(values)
    return {"device": "cpu", "models": [{"model": "llama3_150m", "rungs": rungs}]}


def regressed(checks) -> dict[str, float | None]:
    return {c.path: c.change for c in checks if c.regressed}


def test_identical_results_pass():
    checks = regress.compare(ladder_result(), ladder_result())
    assert len(checks) == 4  # tokens/s and memory of the two rungs that ran
    assert not regressed(checks)
    assert {c.path for c in checks} >= {"models[model=llama3_150m].rungs[rung=eager].tokens_per_s"}


def test_speed_drop_beyond_the_tolerance_is_a_regression():
    slower = ladder_result(**{"+ compile": {"tokens_per_s": 1300.0}})  # 13.3% slower
    assert list(regressed(regress.compare(ladder_result(), slower))) == [
        "models[model=llama3_150m].rungs[rung=+ compile].tokens_per_s"
    ]
    a_bit_slower = ladder_result(**{"+ compile": {"tokens_per_s": 1450.0}})  # 3.3%
    assert not regressed(regress.compare(ladder_result(), a_bit_slower))
    faster = ladder_result(**{"+ compile": {"tokens_per_s": 3000.0}})
    assert not regressed(regress.compare(ladder_result(), faster))


def test_measured_noise_sets_the_speed_tolerance():
    noisy = ladder_result(**{"+ compile": {"tokens_per_s": 1300.0, "step_spread": 0.2}})
    assert not regressed(regress.compare(ladder_result(), noisy))  # 13% < the run's 20% spread
    assert regressed(regress.compare(ladder_result(), noisy, tolerance=0.1))  # fixed 10%
    tol = {c.path: c.tolerance for c in regress.compare(ladder_result(), ladder_result())}
    assert set(tol.values()) == {regress.MIN_SPEED_TOLERANCE, regress.DEFAULT_MEM_TOLERANCE}


def test_spread_from_step_times_and_default_without_steps():
    base = {"device": "cpu", "throughput": {"eager": {"tokens_per_s": 100.0}}}
    cur = copy.deepcopy(base)
    cur["throughput"]["eager"]["tokens_per_s"] = 91.0  # 9% slower
    [check] = regress.compare(base, cur)
    assert check.tolerance == regress.DEFAULT_SPEED_TOLERANCE and not check.regressed
    cur["throughput"]["eager"]["step_times"] = [30.0, 1.0, 1.3, 1.0]  # spread 0.3 / 1.0
    [check] = regress.compare(base, cur)
    assert check.tolerance == pytest.approx(0.3)


def test_memory_growth_is_a_regression_and_a_drop_is_not():
    bigger = ladder_result(eager={"peak_mem_gib": 4.3})  # +7.5%
    assert list(regressed(regress.compare(ladder_result(), bigger))) == [
        "models[model=llama3_150m].rungs[rung=eager].peak_mem_gib"
    ]
    assert not regressed(regress.compare(ladder_result(), bigger, mem_tolerance=0.1))
    smaller = ladder_result(eager={"peak_mem_gib": 2.0})
    assert not regressed(regress.compare(ladder_result(), smaller))


def test_a_rung_that_now_fails_is_a_regression_and_a_new_one_is_not():
    failed = ladder_result(eager={"error": "out of memory"})
    del failed["models"][0]["rungs"][0]["tokens_per_s"]
    del failed["models"][0]["rungs"][0]["peak_mem_gib"]
    changes = regressed(regress.compare(ladder_result(), failed))
    assert set(changes) == {
        "models[model=llama3_150m].rungs[rung=eager].tokens_per_s",
        "models[model=llama3_150m].rungs[rung=eager].peak_mem_gib",
    }
    assert set(changes.values()) == {None}
    # The rung skipped in the baseline runs now: nothing to compare it with, so no verdict.
    now_runs = ladder_result(**{"+ 8-bit AdamW": {"tokens_per_s": 1.0, "peak_mem_gib": 99.0}})
    assert not regressed(regress.compare(ladder_result(), now_runs))


def test_rows_match_by_their_names_not_their_order():
    rows = [
        {"policy": "none", "seq_len": 1024, "tokens_per_s": 100.0},
        {"policy": "full", "seq_len": 1024, "tokens_per_s": 60.0},
    ]
    base = {"device": "cpu", "rows": rows}
    cur = {"device": "cpu", "rows": list(reversed(rows))}
    assert not regressed(regress.compare(base, cur))


def test_lower_is_better_times_and_unmeasured_baselines():
    base = {
        "rows": [
            {"tokens": 1024, "fused": {"peak_mib": 2.0, "time_ms": 10.0}},
            {"tokens": 4096, "plain": {"peak_mib": None, "time_ms": None}},  # OOM then
        ]
    }
    cur = copy.deepcopy(base)
    cur["rows"][0]["fused"]["time_ms"] = 12.0
    cur["rows"][1]["plain"] = {"peak_mib": 900.0, "time_ms": 50.0}
    checks = regress.compare(base, cur)
    assert [c.path for c in checks] == [
        "rows[tokens=1024].fused.peak_mib",
        "rows[tokens=1024].fused.time_ms",
    ]
    assert regressed(checks) == {"rows[tokens=1024].fused.time_ms": pytest.approx(0.2)}


def test_rerun_drops_the_baselines_out_path():
    argv = ["--n-layers", "4", "--out", "x.json", "--steps", "4", "--out=y.json"]
    assert regress._without_out(argv) == ["--n-layers", "4", "--steps", "4"]


def test_ladder_skips_rungs_the_trainer_lacks():
    known = {"--loss", "--compile", "--ac", "--offload-activations", "--max-grad-norm"}
    assert ladder.full_stack(known)[0] == "+ selective AC"
    oib = dict(ladder.RUNGS)["+ optimizer in backward"]
    assert ladder.missing_flags(oib, known) == ["--optimizer-in-backward"]
    everything = known | {"--optimizer", "--optimizer-in-backward"}
    assert ladder.full_stack(everything) == ladder.RUNGS[-1]


def test_ladder_lora_rows_run_with_this_trainer_and_are_not_the_full_stack():
    from compiletune.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    known = {s for action in train._actions for s in action.option_strings}
    for name, flags in ladder.LORA_ROWS:
        assert not ladder.missing_flags(flags, known), name
    assert ladder.full_stack(known) == ladder.RUNGS[-1]


def test_ladder_ratios_skip_over_missing_rungs():
    rows = [
        {"rung": "eager", "tokens_per_s": 100.0, "peak_mem_gib": 4.0},
        {"rung": "+ compile", "tokens_per_s": 150.0, "peak_mem_gib": 2.0},
        {"rung": "+ fused loss", "skipped": "no"},
        {"rung": "+ selective AC", "tokens_per_s": 120.0, "peak_mem_gib": 1.0},
    ]
    ladder.add_ratios(rows)
    assert rows[3]["speed_vs_prev"] == pytest.approx(0.8)
    assert rows[3]["mem_vs_prev"] == pytest.approx(0.5)
    assert rows[3]["mem_vs_eager"] == pytest.approx(0.25)
    assert "speed_vs_prev" not in rows[0] and rows[0]["speed_vs_eager"] == 1.0


def test_peers_headline_against_the_best_transformers_row_per_measure():
    rows = [
        {
            "framework": "transformers",
            "config": "eager",
            "tokens_per_s": 100.0,
            "peak_mem_gib": 6.0,
        },
        {
            "framework": "transformers",
            "config": "checkpointing",
            "tokens_per_s": 80.0,
            "peak_mem_gib": 5.0,
        },
        {"framework": "transformers", "config": "compile", "error": "out of memory"},
        {
            "framework": "compiletune",
            "config": "full stack",
            "tokens_per_s": 160.0,
            "peak_mem_gib": 2.5,
        },
    ]
    h = peers.add_ratios(rows)
    assert (h["leanest_transformers"], h["fastest_transformers"]) == ("checkpointing", "eager")
    assert h["memory_vs_best_transformers"] == pytest.approx(0.5)
    assert h["speed_vs_fastest_transformers"] == pytest.approx(1.6)
    assert h["targets_met"] == {"memory": True, "speed": True}
    assert "speed_vs_transformers_compile" not in h  # the compile row failed


def test_peers_compile_row_is_shown_beside_the_targets_not_in_them():
    rows = [
        {"framework": "transformers", "config": "eager", "tokens_per_s": 100.0, "peak_mem_gib": 6},
        {
            "framework": "transformers",
            "config": "compile",
            "tokens_per_s": 200.0,
            "peak_mem_gib": 4,
        },
        {"framework": "compiletune", "config": "full", "tokens_per_s": 160.0, "peak_mem_gib": 3},
    ]
    h = peers.add_ratios(rows)
    assert h["fastest_transformers"] == h["leanest_transformers"] == "eager"
    assert h["speed_vs_fastest_transformers"] == pytest.approx(1.6)
    assert h["speed_vs_transformers_compile"] == pytest.approx(0.8)
    assert h["memory_vs_transformers_compile"] == pytest.approx(0.75)
    assert rows[1]["speed_vs_fastest_transformers"] == pytest.approx(2.0)


def test_peers_without_eager_or_checkpointing_still_reports():
    """Only the compile row ran (asked so, or the others ran out of memory): no headline, the
    compile ratios, and a table that renders."""
    rows = [
        {"framework": "transformers", "config": "eager", "error": "out of memory"},
        {
            "framework": "transformers",
            "config": "compile",
            "tokens_per_s": 200.0,
            "peak_mem_gib": 4,
        },
        {"framework": "compiletune", "config": "full", "tokens_per_s": 160.0, "peak_mem_gib": 3},
    ]
    assert peers.add_ratios(rows) == {}
    assert rows[2]["speed_vs_transformers_compile"] == pytest.approx(0.8)
    result = {
        "device": "cpu",
        "model": "m",
        "params_m": 1.0,
        "n_layers": 1,
        "seq_len": 8,
        "batch_size": 1,
        "dtype": "bf16",
        "torch": "t",
        "transformers": "t",
        "commit": "c",
        "rows": [
            {**r, "best_tokens_per_s": 1.0, "step_spread": 0.1, "load_1m": 1.0}
            if "tokens_per_s" in r
            else r
            for r in rows
        ],
        "headline": {},
    }
    table = peers.markdown(result)
    assert "out of memory" in table and "| compiletune | full | 160 |" in table


def test_best_of_repeats_keeps_the_fastest_run_and_the_median_peak():
    runs = [
        {"tokens_per_s": 90.0, "peak_mem_gib": 2.0, "step_spread": 0.3},
        {"tokens_per_s": 120.0, "peak_mem_gib": 2.6, "step_spread": 0.1},
        {"error": "out of memory"},
        {"tokens_per_s": 100.0, "peak_mem_gib": 2.2, "step_spread": 0.2},
    ]
    row = common.best_of_repeats(runs)
    assert row["tokens_per_s"] == 120.0 and row["step_spread"] == 0.1
    assert row["peak_mem_gib"] == pytest.approx(2.2)
    assert row["repeat_tokens_per_s"] == [90.0, 120.0, None, 100.0]
    assert common.best_of_repeats([{"error": "x"}]) == {"error": "x"}
    assert "repeat_tokens_per_s" not in common.best_of_repeats(runs[:1])


@pytest.mark.parametrize("how", ["returns", "raises", "keeps"])
def test_bench_work_dir_is_removed_at_exit_unless_kept(how, tmp_path):
    """A bench's scratch directory (checkpoints, Inductor caches) goes when its process ends,
    normally or by an exception; COMPILETUNE_BENCH_KEEP=1 keeps it."""
    import os
    import subprocess

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import common; "
        "w = common.work_dir('ct-bench-test-'); (w / 'ckpt').mkdir(); (w / 'ckpt' / 'x').write_text('1'); "
        "print(w, flush=True); "
        + ("raise RuntimeError('bench crashed')" if how == "raises" else "")
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop(common.KEEP_ENV, None)
    if how == "keeps":
        env[common.KEEP_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(BENCH)], env=env, capture_output=True, text=True
    )
    assert (proc.returncode != 0) == (how == "raises"), proc.stderr
    work = Path(proc.stdout.strip())
    assert work.parent == tmp_path
    assert work.exists() == (how == "keeps")
    if how == "keeps":
        assert str(work) in proc.stderr


def test_activation_bench_leaves_offload_out_on_a_cpu():
    assert activation.default_policies("h100") == [name for name, _ in activation.POLICIES]
    on_cpu = activation.default_policies("cpu")
    assert "none" in on_cpu and "selective" in on_cpu
    assert not [name for name in on_cpu if "offload" in name]


def test_loss_bench_records_a_peer_it_cannot_run_as_skipped(monkeypatch, tmp_path):
    """The head's accumulator variants run; a peer whose package is missing (or with no GPU)
    is recorded as skipped, not an error, and the rows are on disk after each size."""
    loss = _load("loss")
    monkeypatch.setattr(loss.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loss.importlib.util, "find_spec", lambda name: None)
    assert loss.peer_missing("liger") == "liger_kernel is not installed"
    assert loss.available_peers() == [] and loss.peer_missing("fused_bf16acc") is None
    monkeypatch.undo()
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")  # no Inductor compile of the row functions
    variants = ["fused_bf16acc", "fused_fp32acc", "liger", "plain"]
    args = SimpleNamespace(tokens=[64], hidden=16, vocab=300, dtype="float32", iters=1)
    result = loss.run(SimpleNamespace(**vars(args), variants=variants), tmp_path / "r.json")
    (row,) = result["rows"]
    assert row["liger"]["skipped"] == "needs a CUDA GPU" and "liger/plain" not in row
    assert row["fused_bf16acc"]["time_ms"] > 0 and row["fused_fp32acc/plain"]["memory"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == result["rows"]


gpu_check = _load("gpu_check")


@pytest.mark.slow
def test_gpu_check_dry_run_walks_every_step(tmp_path):
    """What the GPU calls run, at toy sizes on CPU, in one invocation (one test: pytest-xdist
    would run a shared fixture once per worker): every step of parts 1-4 and 6 and of the
    plan (parts 7 and 8, issue 63) starts, passes, and leaves its JSON in the part files, the
    tar the device tool brings back and the report. A toy command that an earlier step ran
    (the plan repeats part 2's benches) is run once; its record stands for both steps."""
    import json
    import tarfile

    results, reports, out = tmp_path / "results", tmp_path / "reports", tmp_path / "out"
    argv = ["--dry-run", "--all", "--part", "4", "6", *map(str, gpu_check.PLAN_PARTS)]
    argv += ["--results", str(results), "--reports", str(reports), "--copy-to", str(out)]
    assert gpu_check.main(argv) == 0
    parts = (1, 2, 3, 4, 6, *gpu_check.PLAN_PARTS)
    steps, by_part = {}, {}
    for part in parts:
        data = json.loads((results / f"gpu-check-part{part}-cpu.json").read_text())
        by_part[part] = [s["name"] for s in data["steps"]]
        steps |= {s["name"]: s for s in data["steps"]}
    for part in parts:  # every step of every part, in its order
        assert by_part[part] == [s.name for s in gpu_check.STEPS if s.part == part and s.in_part]
    assert all(s["status"] == "passed" for s in steps.values()), steps
    # each toy command ran once; a step that reuses a run names a step that ran it
    ran = [s for s in steps.values() if "same_as" not in s]
    assert len({tuple(s["argv"]) for s in ran}) == len(ran)
    for s in steps.values():
        if "same_as" in s:
            assert "same_as" not in steps[s["same_as"]] and s["argv"] == steps[s["same_as"]]["argv"]
    assert len(ran) >= len(steps) - 10
    assert all((results / f"{name}-cuda-cpu.json").exists() for name in ("fp8-8b", "lora-8b"))
    # parts 1-3
    assert steps["env"]["result"]["torch"]
    assert steps["cuda-tests"]["tests"]["skipped"] > 0  # collected; skipped without a GPU
    for name in ("attention", "loss", "ladder", "estimate"):
        assert steps[name]["result"]["device"] == "cpu", name
    with tarfile.open(out / "gpu-check-cpu.tar") as tar:
        assert "gpu-check-part3-cpu.json" in tar.getnames()
    # parts 4 and 6, the speed sets: the 8B rows with the estimate column's plumbing, the
    # rollout bench with its three CPU variants
    (row,) = steps["ladder-8b"]["result"]["models"][0]["rungs"]
    assert row["rung"] == "8B LoRA r16" and row["tokens_per_s"] > 0
    rows = steps["rollout-1b"]["result"]["rows"]
    assert len(rows) == 3 and all(r["tokens_per_s"] > 0 for r in rows)
    # the plan (both calls): the CUDA tests collected and skipped, its benches' JSON
    assert steps["first-gpu-tests"]["tests"]["skipped"] > 0
    for name in ("ladder-1b-plan", "fp8-8b", "lora-8b", "recipe-8b-plan", "rollout-1b-plan"):
        assert steps[name]["result"]["device"] == "cpu", name
    text = next(reports.glob("*-gpu-check-cpu.md")).read_text()
    assert all(f"## Part {part}" in text for part in parts)


def test_gpu_check_deadline_skips_and_refuses_cpu(tmp_path, capsys):
    argv = ["--steps", "env", "--results", str(tmp_path), "--reports", str(tmp_path)]
    assert gpu_check.main(argv) == 2  # not on a CPU without --dry-run
    assert gpu_check.main([*argv, "--dry-run", "--deadline", "5"]) == 0
    import json

    step = json.loads((tmp_path / "gpu-check-part1-cpu.json").read_text())["steps"][0]
    assert step["status"] == "skipped" and "deadline" in step["reason"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "nope", "--dry-run"])


def test_gpu_check_plan_runs_in_the_issues_order_within_two_calls():
    """The 15-minute plan: call 1 (part 7) the never-run CUDA tests, then the 1B compiled
    baseline and ladder; call 2 (part 8) the speed rows in the issue's order. Every step it
    must start fits its call's --deadline (320 s, 6.5 minutes less the set-up)."""
    part = {p: [s for s in gpu_check.STEPS if s.part == p] for p in gpu_check.PLAN_PARTS}
    # the ladder's offload rung is the offload a memory target needs (issue 63, item 3)
    assert [s.name for s in part[7]] == [
        "env-7",
        "first-gpu-tests",
        "ladder-1b-plan",
        "offload-1b-plan",
    ]
    assert [s.name for s in part[8]] == [
        "env-8",
        "loss-peers-plan",
        "fp8-8b",
        "lora-8b",
        "recipe-8b-plan",
        "moe-gpt-oss-plan",
        "moe-deepseek-v3-plan",
        "rollout-1b-plan",
        "linear-attention-plan",
    ]
    assert sum(s.min_s for s in part[7]) <= 320  # call 1 reaches every step
    assert all(s.min_s <= 320 for s in part[8])
    tests = " ".join(gpu_check.FIRST_GPU_TESTS)
    for path in ("test_cuda_varlen", "test_gated_delta", "test_fp8", "test_quantized"):
        assert path in tests
    for word in ("varlen", "fla", "sinks", "rollout", "fp8", "mxfp4"):
        assert word in gpu_check.FIRST_GPU_K.split(" or ")
    # the commands a later session copies: in the module's docstring, parts 7 and 8
    assert "--part 7 --deadline 320" in gpu_check.__doc__ and "`--part 8`" in gpu_check.__doc__


def test_gpu_check_dry_run_makes_each_toy_run_once(tmp_path, monkeypatch):
    """--dry-run runs a toy command once: a later step with the same command (but for the path
    of its JSON) takes that record and a copy of the JSON; a failed run fails both steps."""
    ran = []

    def fake_step(step, fill, dry, limit):
        ran.append(step.name)
        if step.result:
            out = Path(fill["results"]) / step.result.replace("{dev}", fill["dev"])
            out.write_text(json.dumps({"device": "cpu", "by": step.name}))
        status = "failed" if step.name == "moe-gpt-oss" else "passed"
        record = {"name": step.name, "part": step.part, "status": status, "seconds": 1.0}
        return record | {"stdout_tail": "ok", "stderr_tail": ""}

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    names = ["env", "ladder-8b", "env-7", "fp8-8b", "recipe-8b-plan", "moe-gpt-oss"]
    names += ["moe-gpt-oss-plan"]
    argv = ["--steps", *names, "--dry-run", "--results", str(tmp_path), "--reports", str(tmp_path)]
    assert gpu_check.main(argv) == 1  # moe-gpt-oss and its plan step failed
    assert ran == ["env", "ladder-8b", "recipe-8b-plan", "moe-gpt-oss"]
    copied = json.loads((tmp_path / "fp8-8b-cuda-cpu.json").read_text())
    assert copied == {"device": "cpu", "by": "ladder-8b"}
    steps = {}
    for part in (1, 2, 4, 7, 8):
        data = json.loads((tmp_path / f"gpu-check-part{part}-cpu.json").read_text())
        steps |= {s["name"]: s for s in data["steps"]}
    assert steps["fp8-8b"]["same_as"] == "ladder-8b" and steps["env-7"]["same_as"] == "env"
    assert steps["moe-gpt-oss-plan"]["status"] == "failed"
    assert "same_as" not in steps["recipe-8b-plan"]  # --memory-cap-gib: another command
    text = next(tmp_path.glob("*-gpu-check-cpu.md")).read_text()
    assert "| fp8-8b | passed | (the run of ladder-8b) |" in text


def test_gpu_check_report_is_on_disk_after_each_step(tmp_path, monkeypatch):
    """A call killed from outside (the device tool's limit) keeps the report of the steps that
    finished, not only their JSON."""
    calls = []

    def fake_step(step, fill, dry, limit):
        if calls:
            raise KeyboardInterrupt  # killed while the second step runs
        calls.append(step.name)
        record = {"name": step.name, "part": step.part, "status": "passed", "seconds": 1.0}
        return record | {"stdout_tail": "ok", "stderr_tail": ""}

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    argv = ["--steps", "env-7", "offload-1b-plan", "--dry-run"]
    argv += ["--results", str(tmp_path), "--reports", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(argv)
    text = next(tmp_path.glob("*-gpu-check-cpu.md")).read_text()
    assert "## Part 7" in text and "| env-7 | passed |" in text
