"""python -m conformance: exit code rule, report files, probes."""
import json

import pytest

from conformance.__main__ import main, must_pass_failures
from conformance.harness import Result
from conformance.probes import ProbeRow, run_probes
from conformance.registry import REGISTRY, load_plugin

PLUGINS = "conformance_broken_plugins"


def test_exit_code_is_nonzero_when_a_plugin_fails_and_report_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_NO_PROGRESS", "1")
    code = main(["--impl", f"{PLUGINS}:per_block_softmax", "--impl", "torch.sdpa.math", "--case", "fp32_gqa",
                 "--no-probes", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 1
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


@pytest.mark.parametrize("impl,status,conforms,decides", [
    ("jax_impl.xla", "FAIL", None, True),
    ("jax_impl.pallas_triton", "error", None, True),
    ("jax_impl.reference", "n.s.", None, False),
    ("mod:fn", "FAIL", None, True),
    ("mod:fn", "n.s.", None, False),
    ("jax.nn.xla", "FAIL", None, False),
    ("torch.sdpa.flash", "error", None, False),
    ("jax_impl.xla", "pass", False, True),
    ("jax_impl.xla", "pass", True, False),
])
def test_exit_code_rule(impl, status, conforms, decides):
    results = [Result("case", impl, status)]
    probes = [ProbeRow("probe", impl, "observed", conforms)]
    assert bool(must_pass_failures(results, probes)) == decides


def test_jax_impl_xla_follows_design_in_every_probe():
    rows = run_probes([REGISTRY["jax_impl.xla"].on("cpu")])
    assert len(rows) == 6 and all(r.conforms for r in rows), [(r.probe, r.observation) for r in rows]


@pytest.mark.parametrize("plugin,probe,observation", [
    ("nan_empty_rows", "probe_empty_rows", "out NaN"),
    ("wrong_causal_alignment", "probe_causal_q<k", "bottom-right"),
    ("forgotten_scale", "probe_default_scale", "1"),
])
def test_probes_report_what_a_broken_plugin_does(plugin, probe, observation):
    (row,) = run_probes([load_plugin(f"{PLUGINS}:{plugin}", device="cpu")], names={probe})
    assert row.observation.startswith(observation), row.observation
    assert row.conforms is False  # a plug-in is held to DESIGN.md like jax_impl
