"""The example runs as the README says: torchrun, two processes, the CPU (quick mode)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_distributed_chains_example_runs_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    command = [torchrun, "--standalone", "--nproc_per_node=2"]
    script = [str(ROOT / "examples" / "distributed_chains.py"), "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, *script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1 of 2 on cpu: holds chains [1, 3]" in result.stdout
    assert "rank 0 of 2 on cpu: holds chains [0, 1, 2, 3]" in result.stdout
    assert "stores under" in result.stdout and "'chain': 4" in result.stdout
    assert "deep ensemble of 4" in result.stdout
