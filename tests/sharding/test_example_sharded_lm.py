"""examples/train_sharded_lm.py: losses on a (data=2, seq=4) mesh match one device step by step."""
import os
import subprocess
import sys

from _spawn import ROOT


def test_sharded_lm_losses_match_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_sharded_lm.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]  # the script asserts the losses match
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 5
    sharded_compile = [line for line in lines if line.startswith("compiled step")][-1]
    assert " 0 all-gathers" in sharded_compile and not sharded_compile.startswith("compiled step: 0 ")
