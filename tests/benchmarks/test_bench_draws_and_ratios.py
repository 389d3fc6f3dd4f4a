"""Two things the GPU run leans on: a configuration's inputs are drawn once for every
implementation and both modes (a B=4, H=16, L=8192 set takes seconds of numpy), and the
Markdown report puts every implementation's time over torch cuDNN's in one table."""
from __future__ import annotations

import dataclasses

from benchmarks import measure, report, suites
from benchmarks.__main__ import run
from conformance.cases import Shape
from conformance.registry import Adapter, Prepared


class _Prepared(Prepared):
    def __init__(self, log, inputs):
        self.info, self.log, self.inputs = {}, log, inputs

    def run(self):
        self.log.append(self.inputs)

    def memory_analysis(self):
        return None


@dataclasses.dataclass(frozen=True)
class _Recording(Adapter):
    log: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def _prepare(self, inputs, *, backward):
        return _Prepared(self.log, inputs)


def test_a_configurations_inputs_are_drawn_once_for_every_implementation_and_mode(monkeypatch):
    draws = []
    real = measure.make_inputs
    monkeypatch.setattr(measure, "make_inputs", lambda case: draws.append(case) or real(case))
    monkeypatch.setattr(measure, "_last_draw", ((), []))
    shape = Shape(2, 2, 32, 8)
    configs = (suites.Config(shape, None, "fwd"), suites.Config(shape, None, "fwd+bwd"),
               suites.Config(shape, "top_left", "fwd"))
    suite = suites.Suite("test", "tiny", configs, max_repeats=3, min_repeats=3, measure_budget_s=0.0, input_sets=2)
    a, b = _Recording("fake.a", "jax", "cpu"), _Recording("fake.b", "torch", "cpu")
    rows, _, _ = run(suite, [a, b], "cpu", check=False, progress=False)
    assert all(r.status == measure.OK for r in rows), [r.reason for r in rows]
    # Two seeds for the non-causal case (both modes, both adapters), two for the causal one.
    assert [(c.causal, c.seed) for c in draws] == [(None, 0), (None, 1), ("top_left", 0), ("top_left", 1)]
    seen = lambda log: {id(x) for x in log}
    assert seen(a.log) == seen(b.log) and len(seen(a.log)) == 4
    # Each set's arrays differ from the other's (fresh draws, not a copy of one).
    first, second = measure.draw_inputs(configs[2], 2)
    assert not (first.q == second.q).all()


def _row(impl, median, status=measure.OK, **config):
    fields = dict(mode="fwd", dtype="bfloat16", batch=4, heads=16, kv_heads=16, q_len=8192, kv_len=8192,
                  head_dim=128, causal="none") | config
    return measure.Row(impl, "torch" if impl.startswith("torch") else "jax", "cuda", status=status,
                       median_ms=median, **fields)


def test_the_report_tables_every_time_over_torch_cudnns():
    rows = [_row("jax_impl.mosaic_gpu", 2.2), _row("torch.sdpa.cudnn", 2.0), _row("jax_impl.pallas_triton", 3.0),
            _row("jax_impl.pallas_triton", 7.0, mode="fwd+bwd"), _row("torch.sdpa.cudnn", 5.0, mode="fwd+bwd"),
            _row("jax_impl.mosaic_gpu", 4.0, measure.WRONG, mode="fwd+bwd"),
            _row("jax_impl.mosaic_gpu", 1.0, causal="top_left")]  # no cuDNN row there: no line
    table = report.versus_reference(rows)
    assert table[0] == ["mode", "D", "causal", "B", "H", "L", "torch.sdpa.cudnn ms", "jax_impl.mosaic_gpu",
                        "jax_impl.pallas_triton"]
    assert table[1:] == [["fwd", "128", "none", "4", "16", "8192", "2", "1.10", "1.50"],
                         ["fwd+bwd", "128", "none", "4", "16", "8192", "5", "-", "1.40"]]
    suite = suites.get_suite("gpu_large")
    text = report.markdown(rows, {}, suite, "cuda", 1.0, [], [])
    assert "## Time over torch.sdpa.cudnn's" in text and "| fwd     | 128 | none" in text
    without = [r for r in rows if r.impl != "torch.sdpa.cudnn"]
    assert report.versus_reference(without) == []
    assert "Time over" not in report.markdown(without, {}, suite, "cuda", 1.0, [], [])
