"""Other frameworks' kernels through the harness: tokamax (the `peers` extra) and flash_attn (CUDA)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.registry import default_device, get_adapter

REPO = Path(__file__).resolve().parents[2]


def _skip_unless_runnable(name: str, device: str):
    why = get_adapter(name, device).available()
    if why:
        pytest.skip(f"{name} adapter on {device}: {why}")


def test_tokamax_runs_through_the_cli_and_is_judged(tmp_path):
    _skip_unless_runnable("tokamax", "cpu")
    # in a fresh process with the harness's own flags on its command line: tokamax reads absl
    # flags, which must not try to parse --impl / --case
    run = subprocess.run([sys.executable, "-m", "conformance", "--impl", "tokamax", "--case", "fp32_gqa",
                          "--case", "fp32_plain", "--device", "cpu", "--out", str(tmp_path)],
                         cwd=tmp_path, env=dict(os.environ, CONFORMANCE_NO_PROGRESS="1", PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads((tmp_path / "conformance_quick.json").read_text())
    assert {r["case"]: r["status"] for r in data["results"]} == {"fp32_plain": "pass", "fp32_gqa": "pass"}
    empty_rows = next(p for p in data["probes"] if p["probe"] == "probe_empty_rows")
    assert not empty_rows["observation"].startswith(("error", "n.s.")), empty_rows


def test_flash_attn_adapter_runs_where_flash_attn_imports():
    device = default_device()
    _skip_unless_runnable("flash_attn", device)  # the reason shows in pytest -rs
    from conformance.cases import Case, make_inputs
    from conformance.harness import run_one
    from conformance.oracle import references
    inputs = make_inputs(Case("fp16_plain", dtype="float16"))
    result = run_one(get_adapter("flash_attn", device), inputs, references(inputs))
    assert result.status == "pass", (result.status, result.reason)
