"""The terminal report fits 120 columns and keeps every reason whole (the Markdown report has the grid)."""
import random

from conformance import report
from conformance.cases import get_suite
from conformance.harness import ERROR, FAIL, NOT_SUPPORTED, PASS, Result
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
        if r.status in (FAIL, ERROR):
            assert f"{r.status} {r.impl} on {r.case}" in flat
    for impl in IMPLS:  # every implementation has its row
        assert any(line.startswith(impl + " ") for line in text.splitlines())


def test_terminal_report_shows_the_grid_where_it_fits():
    cases = get_suite("quick")[:4]
    results = _results(random.Random(), IMPLS[:3], cases)
    text = report.terminal_table(results, cases, IMPLS[:3])
    header = text.splitlines()[0].split()
    assert header == ["case"] + IMPLS[:3]
    assert max(len(line) for line in text.splitlines()) <= WIDTH
