"""A built wheel runs the C++ CPU kernel where no compiler can be found: ``pip wheel .`` (setup.py
compiles the kernel for each x86-64 level of cpu_kernel/levels.py), installed into a fresh venv,
run with ``CXX`` pointing nowhere, only the venv on ``PATH`` (no g++) and an empty kernel cache:
``explain_implementation`` on a CPU names ``cpu``, the prebuilt library for this CPU's level is
the one loaded, and forward and backward (float32, bfloat16) equal this process's first-use
build bit for bit.

Cost: the wheel is built once per session (four compilations of flash_cpu.cc, about 2-4 minutes
on 2 cores) and cached by the hash of its sources under ``$JAX_FLASH_ATTENTION_CACHE`` (else
``~/.cache/jax_flash_attention``)/wheels; the venv and its run take about 20 s. x86-64 Linux
with a compiler only (the wheel's levels are x86-64's).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from jax_impl.cpu_kernel import build, levels

ROOT = Path(__file__).resolve().parents[2]

needs_x86_64_build = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or build._compiler() is None,
    reason="the prebuilt levels are x86-64 Linux's, built by a C++ compiler")

# What the venv's process and this one both compute: forward and gradients of fixed inputs.
PROBE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax_impl import explain_implementation
from jax_impl.flash_attention import flash_attention
from jax_impl.cpu_kernel import build

def results():
    out = {}
    rng = np.random.default_rng(7)
    for dtype in ("float32", "bfloat16"):
        q, k, v = (jnp.asarray(rng.standard_normal((2, n, 4, 40)), dtype) for n in (70, 130, 130))
        f = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="cpu")
        o, vjp = jax.vjp(f, q, k, v)
        for name, x in zip(("out", "dq", "dk", "dv"), (o, *vjp(jnp.ones_like(o)))):
            out[f"{dtype} {name}"] = np.asarray(x.astype(jnp.float32)).tolist()
    return out
"""

RUN_IN_VENV = PROBE + """
import jax_impl
q = jnp.zeros((1, 8, 2, 16))
print(json.dumps(dict(module=jax_impl.__file__, library=str(build.loaded()), reason=build.unavailable(),
                      chosen=explain_implementation(q, q, q, platform="cpu").chosen, results=results())))
"""


def _sources_hash() -> str:
    key = hashlib.sha256()
    for path in sorted([ROOT / "setup.py", ROOT / "pyproject.toml", *ROOT.glob("jax_impl/**/*.py"),
                        *ROOT.glob("jax_impl/cpu_kernel/*.h"), *ROOT.glob("jax_impl/cpu_kernel/*.cc")]):
        key.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return key.hexdigest()[:16]


@pytest.fixture(scope="session")
def wheel() -> Path:
    """The wheel of this checkout (built here once per source state, then reused)."""
    cache = Path(os.environ.get("JAX_FLASH_ATTENTION_CACHE") or Path.home() / ".cache" / "jax_flash_attention")
    out = cache / "wheels" / _sources_hash()
    found = sorted(out.glob("*.whl"))
    if not found:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:  # a copy: the build tree stays out of the checkout
            source = Path(tmp) / "src"
            shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
                ".git", "build", "*.egg-info", "__pycache__", ".venv*", "flash_attention_results", "_build"))
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(source)], check=True, capture_output=True, timeout=1800)
        found = sorted(out.glob("*.whl"))
    assert len(found) == 1, found
    return found[0]


def test_a_cpu_gets_the_best_level_whose_instruction_sets_it_has():
    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "sse2"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert levels.best_level(v4 | {"avx512_bf16", "amx_tile"}) == "x86-64-v4-bf16"
    assert levels.best_level(v4) == "x86-64-v4"
    assert levels.best_level(v3 | {"avx512f", "avx512_bf16"}) == "x86-64-v3"  # no AVX512BW: not v4
    assert levels.best_level(v3) == "x86-64-v3"
    assert levels.best_level(v3 - {"fma"}) == "x86-64"
    assert levels.best_level(set()) == "x86-64"


@needs_x86_64_build
def test_the_wheel_holds_a_library_per_level_and_is_tagged_for_this_platform(wheel):
    import zipfile
    names = set(zipfile.ZipFile(wheel).namelist())
    for level, _, _ in levels.LEVELS:
        assert f"jax_impl/cpu_kernel/prebuilt/{levels.library_name(level)}" in names, level
    assert wheel.name.endswith("linux_x86_64.whl"), wheel.name


@needs_x86_64_build
def test_the_wheel_runs_the_kernel_without_a_compiler_as_the_first_use_build_does(wheel, tmp_path):
    venv = tmp_path / "venv"
    # The host's jax, numpy and torch-free dependencies come from its site-packages; the package
    # itself only from the wheel (asserted below: not this checkout, not an editable install).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
                    "--force-reinstall", str(wheel)], check=True, capture_output=True)
    env = {"PATH": str(venv / "bin"), "CXX": str(tmp_path / "no-compiler-here"), "HOME": str(tmp_path),
           "JAX_FLASH_ATTENTION_CACHE": str(tmp_path / "empty-cache"), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([str(venv / "bin" / "python"), "-c", RUN_IN_VENV], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["module"]).is_relative_to(venv), got["module"]
    assert got["reason"] is None and got["chosen"] == "cpu"
    flags = set(build._cpu_flags_line().partition(":")[2].split())
    assert Path(got["library"]).name == levels.library_name(levels.best_level(flags))
    assert not (tmp_path / "empty-cache").exists()  # nothing was built
    namespace = {}
    exec(PROBE, namespace)
    want = namespace["results"]()
    assert build.prebuilt() is None or os.environ.get("JAX_FLASH_ATTENTION_CPU_MARCH")  # first-use build here
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got["results"][name]), np.asarray(value), err_msg=name)
