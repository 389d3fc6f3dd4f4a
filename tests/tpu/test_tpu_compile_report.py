"""tools/tpu_compile_report.py: one configuration compiles for one v5e chip with its
memory figures, and the committed report lists exactly the code's configurations."""
import json
from pathlib import Path

from tools import tpu_compile_report as report

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks/results/tpu/compile_report.json"


def test_one_configuration_compiles_with_its_memory(implementation):
    """plain d128 causal, fwd+bwd, ours and JAX's flash attention on v5e: compiled, inputs
    12 MiB of bf16 q/k/v ([1, 2048, 8, 128] each), outputs the three gradients."""
    case = report.Case("", 128, True)
    rows = report.report(implementation, ["v5e"], [case], passes=("fwd+bwd",))
    assert [r.program for r in rows] == [implementation, report.JAX_FLASH]
    q_bytes = report.BATCH * report.SEQ_LEN * report.HEADS * 128 * 2
    for row in rows:
        assert row.ok, row.error
        assert row.argument_bytes == 3 * q_bytes
        assert 3 * q_bytes <= row.output_bytes < 3 * q_bytes + 4096  # + the result tuple's table


def test_committed_report_matches_the_configurations():
    """Rows (chip, program, configuration, pass) of the committed report == what the code
    would write for its implementation, chips and configurations, each of them still one of
    the code's (timings and bytes not compared)."""
    committed = json.loads(COMMITTED.read_text())
    rows = [(r["chip"], r["program"], r["case"], r["pass_"]) for r in committed["rows"]]
    assert set(committed["chips"]) <= set(report.CHIPS)
    assert set(committed["configurations"]) <= {c.name for c in report.configurations()}
    assert rows == report.structure(committed["implementation"], committed["chips"],
                                    committed["configurations"])
    assert (committed["batch"], committed["heads"], committed["seq_len"]) == (
        report.BATCH, report.HEADS, report.SEQ_LEN)
