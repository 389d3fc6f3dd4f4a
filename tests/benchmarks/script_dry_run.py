"""A dry run of a device script (benchmarks/run_gpu.sh, run_tpu.sh) on the CPU: stand-in
``python`` and ``timeout`` on PATH record each step's command and limit in $CALLS."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_TIMEOUT = r"""#!/usr/bin/env bash
echo "timeout $1" >> "$CALLS"
shift
exec "$@"
"""


def dry_run(tmp_path, script: str, fake_python: str, timeout_s: int, **env):
    """Runs ``script`` with the stand-ins -> (the run, the recorded calls, $OUT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", fake_python), ("timeout", FAKE_TIMEOUT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls, out = tmp_path / "calls.log", tmp_path / "out"
    environment = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python"),
                       CALLS=str(calls), OUT=str(out), **env)
    run = subprocess.run(["bash", script], cwd=ROOT, env=environment, capture_output=True,
                         text=True, timeout=timeout_s)
    return run, calls.read_text().splitlines(), out
