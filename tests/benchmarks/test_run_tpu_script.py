"""benchmarks/run_tpu.sh dry-run on the CPU: a stand-in python records each step's command and
writes what the step would, a stand-in ``timeout`` records each step's limit; the script's
order, arguments, budget and the files it leaves under $OUT are checked."""
from __future__ import annotations

import shutil

import pytest
from script_dry_run import dry_run

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
if [ "$2" = "benchmarks.tpu_timing" ]; then
  out=$(echo "$*" | sed -n 's/.*--out \([^ ]*\).*/\1/p')
  echo "# timing" > "$out/tpu_timing.md" && echo "{}" > "$out/tpu_timing.json"
fi
if [ "$2" = "conformance" ]; then
  out=$(echo "$*" | sed -n 's/.*--out \([^ ]*\).*/\1/p')
  mkdir -p "$out" && echo "# conformance" > "$out/conformance.md"
  exit "${CONF_RC:-0}"
fi
exit 0
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="run_tpu.sh needs bash")


def _dry_run(tmp_path, **env):
    return dry_run(tmp_path, "benchmarks/run_tpu.sh", FAKE_PYTHON, 60, **env)


def test_conformance_then_timing_with_the_budget_and_files_under_out(tmp_path):
    run, calls, out = _dry_run(tmp_path, TOTAL_BUDGET="200", TIMING_ARGS="--repeats 7")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [c for c in calls if c.startswith("python -m")]
    assert len(steps) == 2, calls
    conformance, timing = steps
    assert conformance == (f"python -m conformance --suite quick --impl jax_impl.mosaic_tpu "
                           f"--impl jax_impl.xla --out {out}/conformance")
    assert timing == f"python -m benchmarks.tpu_timing --out {out} --repeats 7"
    limits = [int(c.split()[1]) for c in calls if c.startswith("timeout")]
    assert limits[0] == 150 and 190 <= limits[1] <= 200  # conformance, then what the budget leaves
    for name in ("run_tpu.log", "environment.txt", "conformance.log", "conformance/conformance.md",
                 "tpu_timing.md", "tpu_timing.json", "tpu_timing.log"):
        assert (out / name).is_file(), name
    log = (out / "run_tpu.log").read_text()
    assert "conformance exit 0" in log and "timing exit 0" in log


def test_a_conformance_failure_fails_the_run_but_the_timing_still_runs(tmp_path):
    run, calls, out = _dry_run(tmp_path, CONF_RC="1")
    assert run.returncode == 1
    assert any("benchmarks.tpu_timing" in c for c in calls)
    assert (out / "tpu_timing.md").is_file()
    assert "conformance exit 1" in (out / "run_tpu.log").read_text()


def test_skip_conformance_runs_the_timing_alone(tmp_path):
    run, calls, _ = _dry_run(tmp_path, SKIP_CONFORMANCE="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [c.split()[2] for c in calls if c.startswith("python -m")] == ["benchmarks.tpu_timing"]


def test_the_timing_script_refuses_a_host_without_a_tpu(capsys):
    import jax
    from benchmarks import tpu_timing
    if jax.devices()[0].platform == "tpu":
        pytest.skip("a TPU is here")
    with pytest.raises(SystemExit) as exit_info:
        tpu_timing.main(["--repeats", "5"])
    assert exit_info.value.code == 2
    assert "needs a TPU: JAX's default device is 'cpu'" in capsys.readouterr().err
