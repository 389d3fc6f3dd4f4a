"""Ring attention across two processes (jax.distributed on localhost, 4 CPU devices each)."""
import json
import os
import socket
import subprocess
import sys

from _spawn import ROOT, SCRIPTS


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_ring_across_two_processes_matches_oracle():
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "two_process_ring.py"), str(i), str(port)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    errors = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert max(errors.values()) < 2e-5, errors
