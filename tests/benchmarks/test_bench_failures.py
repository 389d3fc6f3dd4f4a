"""An out-of-memory or a crash is a recorded result, never the end of the run."""
import dataclasses

import pytest

from benchmarks import measure, suites
from benchmarks.__main__ import run
from conformance.registry import Adapter, Prepared, get_adapter


class _FakePrepared(Prepared):
    def __init__(self, spec, inputs):
        self.info, self.spec, self.inputs, self.runs = {}, spec, inputs, 0

    def run(self):
        self.runs += 1
        if self.spec.fail_in_run_at is not None and self.inputs.case.q_len >= self.spec.fail_in_run_at:
            raise self.spec.error_factory()
        self.spec.log.append((id(self), self.inputs.case.seed))

    def results(self):
        raise AssertionError("not judged in these tests (check=False)")

    def memory_analysis(self):
        return {"temp_size_in_bytes": self.spec.temp_bytes, "output_size_in_bytes": 0} if self.spec.temp_bytes else None


@dataclasses.dataclass(frozen=True)
class FakeAdapter(Adapter):
    fail_in_prepare_at: int | None = None
    fail_in_run_at: int | None = None
    error_factory: object = None
    temp_bytes: int = 0
    log: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def _prepare(self, inputs, *, backward):
        if self.fail_in_prepare_at is not None and inputs.case.q_len >= self.fail_in_prepare_at:
            raise self.error_factory()
        return _FakePrepared(self, inputs)


def _suite(seq_lens=(16, 32, 64)):
    return suites.Suite("test", "tiny", tuple(suites.grid(seq_lens, heads=1, head_dims=(8,), modes=("fwd",))),
                        max_repeats=4, min_repeats=4, measure_budget_s=0.0, input_sets=3)


class XlaRuntimeError(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["prepare", "run"])
@pytest.mark.parametrize("error", [
    lambda: MemoryError("simulated"),
    lambda: RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB"),
    lambda: XlaRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes."),
])
def test_oom_is_recorded_and_longer_lengths_are_implied(where, error):
    key = "fail_in_prepare_at" if where == "prepare" else "fail_in_run_at"
    fake = FakeAdapter("fake.oom", "jax", "cpu", **{key: 32}, error_factory=error)
    rows, _, _ = run(_suite(), [fake, get_adapter("torch.manual", "cpu")], "cpu", check=False, progress=False)
    mine = {r.q_len: r for r in rows if r.impl == "fake.oom"}
    assert mine[16].status == measure.OK and mine[16].median_ms is not None
    assert mine[32].status == measure.OOM
    assert mine[64].status == measure.OOM and "already at L=32" in mine[64].reason
    assert all(r.speedup_vs_manual is None for r in mine.values() if r.status == measure.OOM)
    # the other implementation ran everywhere
    assert all(r.status == measure.OK for r in rows if r.impl == "torch.manual")


def test_a_crash_is_an_error_row_and_the_run_goes_on():
    fake = FakeAdapter("fake.crash", "jax", "cpu", fail_in_run_at=32, error_factory=lambda: ValueError("boom"))
    rows, _, _ = run(_suite(), [fake], "cpu", check=False, progress=False)
    status = {r.q_len: r.status for r in rows}
    assert status == {16: measure.OK, 32: measure.ERROR, 64: measure.ERROR}  # an error implies nothing
    assert "boom" in rows[1].reason


def test_cpu_memory_guard_does_not_run_a_program_that_cannot_fit():
    fake = FakeAdapter("fake.huge", "jax", "cpu", temp_bytes=1 << 60)
    rows, _, _ = run(_suite((16,)), [fake], "cpu", check=False, progress=False)
    assert rows[0].status == measure.OOM and "predicted" in rows[0].reason
    assert fake.log == []  # never run


def test_repeats_cycle_through_the_input_sets_after_an_untimed_first_call():
    fake = FakeAdapter("fake.ok", "jax", "cpu")
    rows, _, _ = run(_suite((16,)), [fake], "cpu", check=False, progress=False)
    (row,) = rows
    assert row.status == measure.OK and row.repeats == 4 and row.input_sets == 3
    seeds = [s for _, s in fake.log]
    assert seeds[0] == 0                        # the warm-up (first call) on set 0
    assert seeds[1:] == [1, 2, 0, 1]            # timed repeats rotate
    assert len({p for p, _ in fake.log}) == 3   # three prepared calls, one per input set


def test_time_budget_records_skipped_rows():
    s = dataclasses.replace(_suite(), time_budget_s=0.0)
    rows, _, notes = run(s, [FakeAdapter("fake.ok", "jax", "cpu")], "cpu", check=False, progress=False)
    assert all(r.status == measure.SKIPPED and "time budget" in r.reason for r in rows)
    assert any("time budget" in n for n in notes)
