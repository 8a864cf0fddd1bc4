"""Shipped recipes (configs/): every one fits the GPUs its header declares, by the estimator,
and its header's estimate is the estimator's; the `configs` command; `--config NAME`; the
placeholders a recipe leaves for the user."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiletune import recipes
from compiletune.cli import main
from compiletune.config import load_yaml, resolve
from compiletune.estimate import estimator as estimate
from compiletune.estimate.fit.capacity import Capacity, fits
from compiletune.estimate.fit.printing import verdict

RECIPES = recipes.all_recipes()


def test_recipes_are_shipped_and_read() -> None:
    assert len(RECIPES) >= 12
    for r in RECIPES:
        assert r.case and r.advice and r.gpus >= 1 and r.gpu_gib > 0, r.name
        resolve(load_yaml(r.name), {})  # every value is a valid option


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipe_fits_its_gpus(recipe: recipes.Recipe) -> None:
    """The estimate of the recipe as shipped fits its declared GPU memory with the reserve (and
    the declared host memory, where it offloads), and matches the header's number."""
    cfg = resolve(load_yaml(recipe.name), {"fsdp": True} if recipe.gpus > 1 else {})
    est = estimate.estimate_memory(cfg, recipe.gpus)
    gib = 2**30
    host = int(recipe.host_gib * gib) if recipe.host_gib else None
    capacity = Capacity(int(recipe.gpu_gib * gib), host)
    assert fits(est, capacity), verdict(est, capacity)
    if est.host_bytes:
        assert host is not None, "a recipe that offloads declares its host memory"
    assert abs(est.peak_bytes / gib - recipe.estimate_gib) <= max(0.05 * recipe.estimate_gib, 0.1)


def test_configs_lists_shows_and_copies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["configs"]) == 0
    table = capsys.readouterr().out
    for r in RECIPES:
        assert r.name in table
    assert "QLoRA r16" in table and "8 x 80 GiB" in table
    assert main(["configs", "show", "llama3_1_8b_lora_24gb"]) == 0
    assert capsys.readouterr().out == recipes.find("llama3_1_8b_lora_24gb").read_text()
    dest = tmp_path / "run.yaml"
    assert main(["configs", "copy", "llama3_1_8b_lora_24gb", str(dest)]) == 0
    assert load_yaml(str(dest)) == load_yaml("llama3_1_8b_lora_24gb")
    assert main(["configs", "copy", "llama3_1_8b_lora_24gb", str(dest)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["configs", "show", "llama9"]) == 2
    err = capsys.readouterr().err
    assert "no shipped recipe named 'llama9'" in err and "debug_cpu_smoke" in err
    assert main(["train", "--config", "nope.yaml"]) == 2
    assert "no such file or shipped recipe" in capsys.readouterr().err


def test_placeholders_refused_by_train_not_by_the_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    name = "llama3_1_8b_qlora_16gb"
    assert main(["train", "--config", name, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--model-dir is still the recipe's placeholder" in err and err.count("\n") == 1
    flags = ["--model-dir", str(tmp_path / "model"), "--output-dir", str(out)]
    assert main(["train", "--config", name, *flags]) == 2
    assert "--data is still the recipe's placeholder" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written
    assert main(["estimate-memory", "--config", name, "--device-memory", "16"]) == 0
    assert "fits in 16 GiB" in capsys.readouterr().out


def test_smoke_recipe_runs_as_shipped(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    args = ["train", "--config", "debug_cpu_smoke", "--output-dir", str(out), "--max-steps", "2"]
    assert main(args) == 0
    assert (out / "summary.json").is_file() and (out / "step_2").is_dir()
