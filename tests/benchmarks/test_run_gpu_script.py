"""benchmarks/run_gpu.sh dry-run on the CPU: a stand-in python records each step's command and
writes the tables a step would, a stand-in ``timeout`` records each step's limit; the script's
order, arguments, budgets, deadline and the files it leaves under $OUT are checked."""
from __future__ import annotations

import re
import shutil

import pytest
from script_dry_run import dry_run

from benchmarks import suites

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "python $* DECODE_BUDGET_S=${DECODE_BUDGET_S:-}" >> "$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "benchmarks" ]; then
  suite=$(echo "$*" | sed -n 's/.*--suite \([a-z_]*\).*/\1/p')
  out=$(echo "$*" | sed -n 's/.*--out \([^ ]*\).*/\1/p')
  mkdir -p "$out" && echo "# $suite" > "$out/bench_$suite.md" && echo "{}" > "$out/bench_$suite.json"
fi
[ "$2" = "pytest" ] && exit 5
exit 0
"""


def _dry_run(tmp_path, **env):
    return dry_run(tmp_path, "benchmarks/run_gpu.sh", FAKE_PYTHON, 120, **env)


def _benchmark_calls(calls):
    return [(re.search(r"--suite (\w+)", c).group(1), c) for c in calls if c.startswith("python -m benchmarks")]


pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="run_gpu.sh needs bash and tar")


def test_the_larger_shape_runs_after_step_3_and_its_tables_land_in_out(tmp_path):
    """The defaults: conformance, step 3 at its floor, the larger shape with 150 s, the masks,
    the Mosaic suites; the gpu lane and the decode suite (both measured) are off."""
    run, calls, out = _dry_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = _benchmark_calls(calls)
    assert [s for s, _ in steps] == ["gpu", "gpu_large", "masks", "mosaic_tiles", "mosaic_dq",
                                     "mosaic_pack"], calls
    assert not [c for c in calls if "pytest" in c]
    # step 3: TOTAL_BUDGET 420 s less the other steps' shares (45 + 150 + 20 + 20 + 45) and the
    # seconds already spent (the stand-ins take almost none)
    gpu_budget = int(dict(steps)["gpu"].split("--time-budget ")[1].split()[0])
    assert 135 <= gpu_budget <= 140, gpu_budget
    assert [c for c in calls if c.startswith("timeout")][0] == "timeout 150"  # conformance
    large = dict(steps)["gpu_large"]
    assert "--device cuda" in large and "--time-budget 150" in large
    assert "--time-budget 45" in dict(steps)["mosaic_tiles"]
    assert "--time-budget 45" in dict(steps)["masks"]  # block-sparse masks and score mods, after 3a
    assert "--time-budget 20" in dict(steps)["mosaic_dq"]  # the backward's dQ strategies
    assert "--time-budget 20" in dict(steps)["mosaic_pack"]  # the forward's packed query group
    for name in ("bench_gpu_large.md", "bench_gpu_large.json", "bench_summary.md", "bench_gpu.json",
                 "bench_mosaic_tiles.md", "bench_mosaic_dq.md", "bench_mosaic_pack.md", "bench_masks.md",
                 "run_gpu.log",
                 "gpu_results.tar.gz"):
        assert (out / name).is_file(), name
    assert (out / "bench_gpu_large.md").read_text() == "# gpu_large\n"
    log = (out / "run_gpu.log").read_text()
    assert "larger shape (B=4, H=16, L=8192) exit 0" in log and "large=0" in log and "masks=0" in log
    assert "decode=skipped" in log and "gpu_tests=skipped" in log


def test_a_late_start_shrinks_the_steps_and_skips_what_does_not_fit(tmp_path):
    """DEADLINE=60 s (the stand-ins take almost no time): step 3 gets what is left less its 20 s of
    start-up and report, the larger shape what is left less its 25, the tile candidates are
    skipped (step 5's 60 s are kept), the decode suite runs; no later step's limit runs past
    the deadline + 15 s; the dQ strategies (step 3c), the packed query group (3d) and the
    masks (3e) are skipped as well. The gpu lane and the decode suite are asked for."""
    run, calls, out = _dry_run(tmp_path, DEADLINE="60", GPU_TESTS_TIMEOUT="60", DECODE_BUDGET="60")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = dict(_benchmark_calls(calls))
    assert set(steps) == {"gpu", "gpu_large", "decode"}
    budget = lambda step: int(steps[step].split("--time-budget ")[1].split()[0])
    # 40 and 35 when the stand-ins take no time; a loaded machine may take a second or two.
    assert 37 <= budget("gpu") <= 40 and 32 <= budget("gpu_large") <= 35, steps
    limits = [int(c.split()[1]) for c in calls if c.startswith("timeout")]
    assert max(limits[2:]) <= 75, limits  # after conformance and the lane: DEADLINE + 15 s
    log = (out / "run_gpu.log").read_text()
    assert "tiles=skipped" in log and "dq=skipped" in log and "pack=skipped" in log and "masks=skipped" in log
    assert "large=0" in log and "decode=0" in log
    assert "DECODE_BUDGET_S=" in steps["decode"]
    # The gpu lane: the Mosaic GPU tests first, then the rest.
    lane = [c for c in calls if "pytest" in c]
    assert "tests/jax_impl/test_mosaic_gpu.py" in lane[0]
    assert "--ignore=tests/jax_impl/test_mosaic_gpu.py" in lane[1]


def test_the_larger_shape_suite_is_the_issues_points():
    """B=4, H=16, L=8192, D=64/128, causal and not, forward and forward+backward, bf16; the
    Mosaic GPU and Triton kernels, jax.nn and torch cuDNN, torch flash; modes adjacent so that
    one draw of inputs serves both."""
    suite = suites.get_suite("gpu_large")
    points = {(c.shape.batch, c.shape.heads, c.shape.seq_len, c.shape.head_dim, c.shape.dtype, c.causal, c.mode)
              for c in suite.configs}
    assert points == {(4, 16, 8192, d, "bfloat16", c, m) for d in (64, 128) for c in (None, "top_left")
                      for m in ("fwd", "fwd+bwd")}
    assert len(suite.configs) == 8
    assert set(suite.impls["cuda"]) == {"jax_impl.mosaic_gpu", "jax_impl.pallas_triton", "jax.nn.cudnn",
                                        "torch.sdpa.cudnn", "torch.sdpa.flash"}
    assert all(a.case() == b.case() for a, b in zip(suite.configs[::2], suite.configs[1::2]))
    assert suite.input_sets == 1 and suite.max_repeats <= 5 and suite.time_budget_s == 75


def test_the_packed_query_group_suite_times_packed_beside_unpacked():
    """GQA with few query rows against a long cache, where the default packs (the rule says
    so for each point) beside the same call unpacked, the Triton kernel and torch's cuDNN."""
    from jax_impl.mosaic_gpu.config import default_config, packs_query_group
    suite = suites.get_suite("mosaic_pack")
    assert suite.impls["cuda"][:2] == ("jax_impl.mosaic_gpu", "benchmarks.mosaic_tiles:unpacked")
    for c in suite.configs:
        s = c.shape
        assert packs_query_group(default_config(s.head_dim, s.dtype), s.seq_len,
                                 s.heads // s.kv_heads), s
        assert (s.kv_len, c.mode) == (8192, "fwd")
