"""python -m benchmarks: command-line errors in one line before any work; what is missing is said."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.__main__ as cli
import conformance.adapters.base as adapters_base

TINY = ["--suite", "quick", "--device", "cpu", "--seq-lens", "16", "--heads", "1", "--repeats", "1"]


@pytest.mark.parametrize("args,message", [
    (["--seq-lens", "abc"], "--seq-lens 'abc' must be comma-separated positive integers"),
    (["--seq-lens", "0,64"], "--seq-lens '0,64' must be comma-separated positive integers"),
    (["--heads", "0"], "--heads 0 must be at least 1"),
    (["--impl", "no_such_impl"], "--impl: unknown implementation 'no_such_impl'"),
    (["--impl", "no_such_module:fn"], "--impl: plug-in 'no_such_module:fn': cannot import 'no_such_module'"),
    (["--impl", "jax.pallas.mha"], "--impl jax.pallas.mha: cannot run on cpu: runs only on cuda"),
    (["--out", "a_file/sub"], "--out 'a_file/sub' is not a writable folder"),
    (["--update-reference", "--out", "x"], "--update-reference writes benchmarks/results/<device>/: it takes no --out"),
])
def test_command_line_errors_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    assert cli.main(["--device", "cpu"] + args) == 2
    captured = capsys.readouterr()
    assert captured.err == f"python -m benchmarks: error: {message}" + captured.err.split(message, 1)[1]
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def _without(monkeypatch, module):
    real = adapters_base.has_module
    fake = lambda name: name != module and real(name)
    monkeypatch.setattr(adapters_base, "has_module", fake)
    monkeypatch.setattr(cli, "has_module", fake)


def test_without_torch_naming_a_torch_row_is_an_error(monkeypatch, capsys):
    _without(monkeypatch, "torch")
    assert cli.main(TINY + ["--impl", "torch.manual", "--no-check"]) == 2
    assert "--impl torch.manual: cannot run on cpu: not installed (torch)" in capsys.readouterr().err


def test_without_torch_the_check_needs_no_check(monkeypatch, capsys):
    _without(monkeypatch, "torch")
    assert cli.main(TINY + ["--impl", "jax_impl.xla"]) == 2
    assert "the float64-oracle check needs torch" in capsys.readouterr().err


def test_without_torch_the_suites_torch_rows_are_left_out_with_a_reason(tmp_path, monkeypatch, capsys):
    _without(monkeypatch, "torch")
    assert cli.main(TINY + ["--no-check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "torch.manual left out: not installed (torch)" in out
    assert "no speedups: the baseline torch.manual is not among the implementations run" in out
    rows = json.loads((tmp_path / "bench_quick.json").read_text())["rows"]
    assert rows and {r["framework"] for r in rows} == {"jax"} and {r["status"] for r in rows} == {"ok"}


def test_without_matplotlib_it_says_there_are_no_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(TINY + ["--impl", "jax_impl.xla", "--out", str(tmp_path)]) == 0
    assert "no PNG plots: matplotlib is not installed" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


def test_default_output_is_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(TINY + ["--impl", "jax_impl.xla", "--no-check"]) == 0
    written = tmp_path / "flash_attention_results" / "benchmarks" / "cpu" / "bench_quick.json"
    env = json.loads(written.read_text())["environment"]
    assert env["command"].startswith("python -m benchmarks --suite quick")
    assert all(k.startswith(("XLA_", "JAX_", "OMP_", "MKL_", "CUDA_VISIBLE", "TF_CPP_")) for k in env["env_vars"])


def test_the_compilation_cache_folder_is_removed_when_the_process_ends(tmp_path):
    """Each run's cache is fresh (first-call times stay honest) and leaves nothing in the
    temporary folder once the process exits."""
    script = (f"import tempfile; tempfile.tempdir = {str(tmp_path)!r}\n"
              "import jax\n"
              "from benchmarks.__main__ import _enable_compile_cache\n"
              "path = _enable_compile_cache()\n"
              "jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3.0)).block_until_ready()\n"
              "import os; print(path, len(os.listdir(path)))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(cli.__file__).parents[1],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    path, entries = run.stdout.split()[-2:]
    assert Path(path).parent == tmp_path and int(entries) > 0  # it cached something
    assert not Path(path).exists()
