"""The CPU bf16 check: measured rates, the one warning, and the benches' dtype."""

from __future__ import annotations

import pytest

from compiletune import hardware


def test_rates_are_measured():
    bf16, fp32 = hardware.cpu_matmul_gflops()
    assert bf16 > 0 and fp32 > 0
    assert hardware.cpu_default_dtype() in ("bf16", "fp32")


@pytest.mark.parametrize("rates, slow", [((0.3, 154.0), True), ((600.0, 154.0), False)])
def test_warns_once_on_a_cpu_without_bf16(monkeypatch, capsys, rates, slow):
    monkeypatch.setattr(hardware, "cpu_matmul_gflops", lambda: rates)
    monkeypatch.setattr(hardware, "_warned", False)
    assert hardware.warn_slow_bf16() is slow
    assert hardware.warn_slow_bf16() is slow
    err = capsys.readouterr().err
    if slow:
        assert err.count("warning:") == 1
        assert "0.3 GFLOP/s against 154.0 GFLOP/s" in err and "--dtype fp32" in err
        assert hardware.cpu_default_dtype() == "fp32"
    else:
        assert err == "" and hardware.cpu_default_dtype() == "bf16"


def test_a_bf16_run_on_a_slow_cpu_says_so(monkeypatch, capsys, tmp_path):
    from compiletune.cli import main

    monkeypatch.setattr(hardware, "cpu_matmul_gflops", lambda: (0.3, 154.0))
    monkeypatch.setattr(hardware, "_warned", False)
    argv = ["train", "--dtype", "bf16", "--seq-len", "16", "--batch-size", "1"]
    assert main([*argv, "--max-steps", "1", "--output-dir", str(tmp_path / "o")]) == 0
    assert "no AVX512-BF16 or AMX" in capsys.readouterr().err
