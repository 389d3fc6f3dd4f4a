"""python -m conformance: exit code rule, report files, probes, command-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.__main__ import main, must_pass_failures
from conformance.harness import Result
from conformance.probes import ProbeRow, run_probes
from conformance.registry import get_adapter, load_plugin

PLUGINS = "conformance_broken_plugins"
JAX_NN = "conformance_jax_nn_plugins"
HERE = Path(__file__).parent
REPO = HERE.parent.parent


def test_exit_code_is_nonzero_when_a_plugin_fails_and_report_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    code = main(["--impl", f"{PLUGINS}:per_block_softmax", "--impl", "torch.sdpa.math", "--case", "fp32_gqa",
                 "--no-probes", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 1
    # without the bar, one line per finished run, printed as it ends (a timed-out run shows how far it got)
    printed = capsys.readouterr().out
    logged = [line.split("] ")[1] for line in printed.splitlines() if line.startswith("[")]
    assert logged == [f"fp32_gqa / {PLUGINS}:per_block_softmax", "fp32_gqa / torch.sdpa.math"]
    # the console ends with the grid, the failure with its reason, and where the report went
    grid = printed[printed.index("\ncase "):]
    assert " ".join(grid.split()).startswith(f"case {PLUGINS}:per_block_softmax torch.sdpa.math")
    assert f"FAIL {PLUGINS}:per_block_softmax on fp32_gqa: out: err " in " ".join(grid.split())
    assert grid.index(f"FAIL {PLUGINS}") < grid.index("1 cases x 2 implementations") < grid.index("heat map")
    data = json.loads((tmp_path / "conformance_quick.json").read_text())
    statuses = {r["impl"]: r["status"] for r in data["results"]}
    assert statuses == {f"{PLUGINS}:per_block_softmax": "FAIL", "torch.sdpa.math": "pass"}
    md = (tmp_path / "conformance_quick.md").read_text()
    assert "Tolerance policy" in md and "jax" in md and "torch" in md


def test_exit_code_is_zero_for_a_passing_or_unsupported_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    args = ["--case", "fp32_gqa", "--case", "fp32_segments", "--no-probes", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["--impl", f"{PLUGINS}:correct"] + args) == 0
    data = json.loads((tmp_path / "conformance_quick.json").read_text())
    assert {r["case"]: r["status"] for r in data["results"]} == {"fp32_gqa": "pass", "fp32_segments": "n.s."}
    assert main(["--impl", f"{PLUGINS}:always_not_implemented"] + args) == 0


def _cli(*args, cwd):
    env = dict(os.environ, CONFORMANCE_NO_PROGRESS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


# fp16 cases: jax.nn's fp16 dot is refused by XLA on CPU (a platform limit, "n.s."); a case
# with a keyword jax.nn lacks; a case jax.nn runs; the probes (a plug-in's never decide).
JAX_NN_ARGS = ("--case", "fp16_plain", "--case", "fp32_segments", "--case", "fp32_gqa", "--device", "cpu")


@pytest.mark.parametrize("plugin", ["faithful", "forwarding"])
def test_a_faithful_jax_nn_wrapper_exits_0(tmp_path, plugin):
    run = _cli("--impl", f"{JAX_NN}:{plugin}", *JAX_NN_ARGS, "--out", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    results = {r["case"]: r for r in json.loads((tmp_path / "conformance_quick.json").read_text())["results"]}
    assert {c: r["status"] for c, r in results.items()} == {"fp16_plain": "n.s.", "fp32_segments": "n.s.",
                                                          "fp32_gqa": "pass"}
    assert "platform cannot run it" in results["fp16_plain"]["reason"]
    # the terminal says why a cell is n.s. and what the number in a cell means
    assert "F16_F16_F32" in run.stdout and "segment_ids" in run.stdout
    assert "error / tolerance" in run.stdout
    assert "uniform over all keys" in run.stdout  # its empty-row probe is reported, not judged


def test_a_wrong_scale_jax_nn_wrapper_exits_nonzero(tmp_path):
    run = _cli("--impl", f"{JAX_NN}:wrong_scale", *JAX_NN_ARGS, "--no-probes", "--out", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{JAX_NN}:wrong_scale on fp32_gqa" in run.stderr


def test_a_plugin_declares_what_it_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    monkeypatch.syspath_prepend(str(HERE))
    code = main(["--impl", f"{JAX_NN}:declares_capability", "--case", "bf16_plain", "--no-probes",
                 "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    (result,) = json.loads((tmp_path / "conformance_quick.json").read_text())["results"]
    assert (result["status"], result["reason"]) == ("n.s.", "fp32 only")


@pytest.mark.parametrize("args,message", [
    (["--impl", "no_such_impl"], "--impl: unknown implementation 'no_such_impl'; known: jax_impl.cpu"),
    (["--impl", "no_such_module:fn"], "--impl: plug-in 'no_such_module:fn': cannot import 'no_such_module': "
                                      "ModuleNotFoundError"),
    (["--impl", f"{PLUGINS}:no_such_fn"], f"--impl: plug-in '{PLUGINS}:no_such_fn': '{PLUGINS}' has no attribute"),
    (["--case", "nosuchcase"], "--case 'nosuchcase' matches no case of suite 'quick'"),
    (["--out", "a_file/sub"], "--out 'a_file/sub' is not a writable folder"),
    (["--update-reference", "--case", "fp32"], "--update-reference rewrites the committed report"),
])
def test_command_line_errors_are_one_line_before_any_work(tmp_path, args, message):
    (tmp_path / "a_file").write_text("")
    run = _cli(*args, "--device", "cpu", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == f"python -m conformance: error: {message}" or \
        (run.stderr.count("\n") == 1 and message in run.stderr), run.stderr
    assert run.stdout == ""  # nothing ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_default_output_is_under_the_current_directory_not_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    monkeypatch.chdir(tmp_path)
    assert main(["--impl", "torch.sdpa.math", "--case", "fp32_gqa", "--no-probes", "--device", "cpu"]) == 0
    report = tmp_path / "flash_attention_results" / "conformance" / "cpu" / "conformance_quick.json"
    data = json.loads(report.read_text())
    assert data["environment"]["command"].startswith("python -m conformance --impl torch.sdpa.math")


def test_reports_hold_no_machine_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    assert main(["--impl", f"{PLUGINS}:returns_query", "--case", "fp32_gqa", "--no-probes", "--device", "cpu",
                 "--out", str(tmp_path)]) == 1
    for name in ("conformance_quick.json", "conformance_quick.md"):
        text = (tmp_path / name).read_text()
        assert str(REPO) not in text and sys.prefix not in text, name


@pytest.mark.parametrize("impl,status,conforms,decides", [
    ("jax_impl.xla", "FAIL", None, True),
    ("jax_impl.pallas_triton", "error", None, True),
    ("jax_impl.reference", "n.s.", None, False),
    ("mod:fn", "FAIL", None, True),
    ("mod:fn", "n.s.", None, False),
    ("mod:fn", "pass", False, False),   # a plug-in's probes are reported, never decide
    ("jax.nn.xla", "FAIL", None, False),
    ("torch.sdpa.flash", "error", None, False),
    ("jax_impl.xla", "pass", False, True),
    ("jax_impl.xla", "pass", True, False),
])
def test_exit_code_rule(impl, status, conforms, decides):
    results = [Result("case", impl, status)]
    probes = [ProbeRow("probe", impl, "observed", conforms)]
    assert bool(must_pass_failures(results, probes)) == decides


@pytest.mark.parametrize("impl", ["jax_impl.xla", "jax_impl.cpu"])
def test_jax_impl_follows_the_semantics_in_every_probe(impl):
    """Every probe runs and conforms (the CPU kernel takes the dense mask two of them need)."""
    rows = run_probes([get_adapter(impl, "cpu")])
    assert not [r.probe for r in rows if r.observation.startswith("n.s.")]
    assert len(rows) == 6 and all(r.conforms for r in rows), [(r.probe, r.observation) for r in rows]


@pytest.mark.parametrize("plugin,probe,observation", [
    ("nan_empty_rows", "probe_empty_rows", "out NaN"),
    ("wrong_causal_alignment", "probe_causal_q<k", "bottom-right"),
    ("forgotten_scale", "probe_default_scale", "1"),
])
def test_probes_report_what_a_broken_plugin_does(plugin, probe, observation):
    (row,) = run_probes([load_plugin(f"{PLUGINS}:{plugin}", device="cpu")], names={probe})
    assert row.observation.startswith(observation), row.observation
    assert row.conforms is False  # marked as differing from docs/semantics.md (not deciding the exit code)
