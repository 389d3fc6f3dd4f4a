"""The example scripts of the documentation run as written and pass their own checks against
float64 numpy or the one-device call (each in a fresh Python: the ring needs 4 virtual devices)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, expected", [
    ("masks_and_scores.py", "documents: max |error| vs float64"),
    ("ring_attention.py", "ring over 4 devices vs one device"),
])
def test_docs_example_runs(script, expected):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert expected in proc.stdout
