"""Context parallelism across processes (jax.distributed on localhost, CPU collectives by gloo):
the ring over 2 processes x 4 devices, and the hybrid over 4 "hosts" x 2 devices."""
import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from _spawn import ROOT, SCRIPTS

needs_gloo = pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason=f"jax {jax.__version__} has no jax_cpu_collectives_implementation (gloo CPU collectives)")


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(script: str, processes: int, devices_each: int, timeout: float = 240) -> dict:
    """Start ``processes`` copies of ``script`` (argv: process id, coordinator port), wait for all
    (killing every one still alive on a timeout or a failure) and return process 0's JSON line."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / script), str(i), str(port)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(processes)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} of {script} failed ({p.returncode}):\n{err[-4000:]}"
    return json.loads(outputs[0][0].strip().splitlines()[-1])


@needs_gloo
def test_ring_across_two_processes_matches_oracle():
    errors = run_processes("two_process_ring.py", 2, 4)
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert max(errors.values()) < 2e-5, errors


@needs_gloo
def test_hybrid_across_four_processes_matches_oracle_and_gathers_nothing():
    """Mesh (host=4, chip=2), one row per process, the sequence over both axes: the all-to-all
    inside each process, the ring across them; causal GQA with dropout, sinks and kv lengths,
    fwd+bwd vs torch_ref float64 and the one-device call."""
    r = run_processes("four_process_hybrid.py", 4, 2)
    assert r["all_gathers"] == 0 and r["all_to_alls"] > 0 and r["permutes"] > 0, r
    assert set(r["errors"]) == {"out", "dq", "dk", "dv", "dsinks"}, r
    assert max(r["errors"].values()) < 2e-5, r["errors"]
    assert r["single"] < 2e-5, r["single"]
