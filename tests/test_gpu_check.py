"""bench/gpu_check.py, the script a GPU machine runs unattended, works: here on the CPU at tiny shapes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_and_agrees_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--smoke", "--device", "cpu", "--no-compile", "--steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "max relative difference cpu vs cpu 0.00e+00" in out
    assert "speculative == greedy on cpu: True" in out
    assert "D=1 eager" in out and "D=3 eager" in out and "tokens/s" in out
    assert out.rstrip().endswith("agreement ok")
