"""The terminal report fits 120 columns, keeps every reason whole (the Markdown report has the grid)
and ends with the summary and each failure's reason."""
import random

from conformance import report
from conformance.cases import get_suite
from conformance.harness import ERROR, FAIL, NOT_SUPPORTED, PASS, Result
from conformance.probes import ProbeRow
from conformance.tolerance import Verdict

IMPLS = ["jax_impl.cpu", "jax_impl.xla", "jax_impl.pallas_triton", "jax_impl.mosaic_gpu", "jax_impl.reference",
         "jax.dense", "jax.nn.xla", "tokamax", "torch.manual", "torch.sdpa.auto", "torch.sdpa.math",
         "torch.sdpa.flash"]
WIDTH = 120  # what a newcomer's terminal shows
LONG_REASON = ("Flash attention kernel not used because: the query, key and value tensors must share one "
               "dtype and the kernel does not take an attention mask with a dense layout of this shape, "
               "nor a dropout rate above zero on this device")


def _results(rng, impls, cases):
    out = []
    for case in cases:
        for impl in impls:
            status = rng.choice([PASS, PASS, FAIL, NOT_SUPPORTED, ERROR])
            ratio = rng.uniform(0.01, 0.99) if status == PASS else rng.uniform(1.5, 40.0)
            verdicts = [] if status in (NOT_SUPPORTED, ERROR) else [
                Verdict("out", ratio * 1e-5, 1e-6, 1e-5, 1e-6, status == PASS)]
            reason = (LONG_REASON if impl == "torch.sdpa.flash" else f"{impl} has no {case.name}") \
                if status in (NOT_SUPPORTED, ERROR) else None
            out.append(Result(case.name, impl, status, reason, verdicts))
    return out


def test_terminal_report_fits_120_columns_and_keeps_reasons_whole():
    rng = random.Random()
    cases = get_suite("quick")
    results = _results(rng, IMPLS, cases)
    text = report.terminal_table(results, cases, IMPLS)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    flat = " ".join(text.split())
    for r in results:
        if r.status in (NOT_SUPPORTED, ERROR):
            assert r.reason in flat  # whole, folded at word boundaries, never cut
        if r.status == ERROR:
            assert f"error {r.impl} on {r.case}: {r.reason}" in flat
        if r.status == FAIL:  # which output failed, by how much, against which tolerance
            v = r.verdicts[0]
            assert f"FAIL {r.impl} on {r.case}: out: err {v.error:.3g} / tol {v.tolerance:.3g}" in flat
    for impl in IMPLS:  # every implementation has its row
        assert any(line.startswith(impl + " ") for line in text.splitlines())


def _last_footnote_and_table_start(text: str, header: str) -> tuple[int, int]:
    lines = text.splitlines()
    footnotes = [n for n, line in enumerate(lines) if line.startswith("  [")]
    return max(footnotes), next(n for n, line in enumerate(lines) if line.split()[:1] == [header])


def test_terminal_report_ends_with_the_summary_and_the_failures():
    cases = get_suite("quick")
    results = _results(random.Random(), IMPLS, cases)
    text = report.terminal_table(results, cases, IMPLS)
    last_footnote, table = _last_footnote_and_table_start(text, "implementation")
    assert last_footnote < table
    after = text.splitlines()[table:]
    assert [line.split()[0] for line in after[2:2 + len(IMPLS)]] == IMPLS  # the summary rows, then
    failures = [line for line in after[2 + len(IMPLS):] if line.startswith("  ") and line[2] != " "]
    assert len(failures) == sum(r.status in (FAIL, ERROR) for r in results)


def test_terminal_report_shows_the_grid_where_it_fits():
    cases = get_suite("quick")[:4]
    results = _results(random.Random(), IMPLS[:3], cases)
    results[0] = Result(cases[0].name, IMPLS[0], NOT_SUPPORTED, "no such feature")  # one footnote at least
    text = report.terminal_table(results, cases, IMPLS[:3])
    last_footnote, grid = _last_footnote_and_table_start(text, "case")
    assert last_footnote < grid
    assert text.splitlines()[grid].split() == ["case"] + IMPLS[:3]
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_the_probes_show_as_a_count_and_each_difference():
    rows = [ProbeRow("probe_empty_rows", "jax_impl.xla", "out 0, dq 0, no NaN", True),
            ProbeRow("probe_empty_rows", "jax_impl.cpu", "out NaN, dq NaN, NaN in out", False),
            ProbeRow("probe_empty_rows", "jax.nn.xla", "out uniform over all keys, dq 0, no NaN"),
            ProbeRow("probe_causal_q<k", "torch.sdpa.auto", "top-left [ran flash]"),
            ProbeRow("probe_default_scale", "torch.flex.eager", "n.s.: no scale")]
    text = report.probe_summary(rows)
    flat = " ".join(text.split())
    assert flat.startswith("probes: 2 of 4 observations as docs/semantics.md says") and "; 1 not run" in flat
    assert "probe_empty_rows jax_impl.cpu: out NaN, dq NaN, NaN in out <-- violates docs/semantics.md" in flat
    assert "probe_empty_rows jax.nn.xla: out uniform over all keys, dq 0, no NaN <-- differs" in flat
    assert "jax_impl.xla" not in text and "torch.sdpa.auto" not in text and "torch.flex.eager" not in text
