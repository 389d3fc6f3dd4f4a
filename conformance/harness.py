"""Run cases through adapters and judge every output and gradient with ``tolerance.judge``."""
from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable, Iterable

import numpy as np

from conformance import tolerance
from conformance.cases import Case, Inputs, make_inputs
from conformance.oracle import References, references
from conformance.adapters.base import Adapter
from conformance.runs import NotSupported, platform_limitation

PASS, FAIL, NOT_SUPPORTED, ERROR = "pass", "FAIL", "n.s.", "error"


@dataclasses.dataclass
class Result:
    case: str
    impl: str
    status: str                       # pass | FAIL | n.s. | error
    reason: str | None = None         # why n.s., or the error
    verdicts: list = dataclasses.field(default_factory=list)  # tolerance.Verdict per output
    info: dict = dataclasses.field(default_factory=dict)
    note: str | None = None           # e.g. "wrong only in rows with no allowed key"
    unjudged: str | None = None       # gradients the implementation refused, and why
    seconds: float = 0.0              # prepare + first run (compile included)

    @property
    def worst_ratio(self) -> float | None:
        return max((v.ratio for v in self.verdicts), default=None)

    @property
    def worst(self) -> tolerance.Verdict | None:
        return max(self.verdicts, key=lambda v: v.ratio, default=None)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["verdicts"] = [dict(dataclasses.asdict(v), ratio=_finite(v.ratio)) for v in self.verdicts]
        for v in d["verdicts"]:
            for key in ("error", "baseline_error", "tolerance", "relative_norm"):
                v[key] = _finite(v[key])
        d["worst_ratio"] = _finite(self.worst_ratio) if self.worst_ratio is not None else None
        return d


def _finite(x):
    """JSON has no inf/NaN: they become strings."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else str(x)


def claims_failure(result: Result) -> bool:
    return result.status in (FAIL, ERROR)


def judge_results(values: dict, refs: References, dtype: str, *, forward_only: bool = False,
                  not_differentiated: str | None = None) -> list[tolerance.Verdict]:
    """A verdict for out and every gradient the oracle has (dq, dk, dv, dbias, d<mod_aux>); a
    gradient the implementation refused (``not_differentiated`` says why) is left out."""
    verdicts = []
    # dsinks is the oracle's alone: no adapter returns it (the sinks' gradient is tested in
    # tests/jax_impl/test_flash_dropout_sinks.py).
    for name in ("out",) if forward_only else tuple(n for n in refs.oracle if n != "dsinks"):
        if name not in values:
            if not_differentiated and name != "out":
                continue
            raise ValueError(f"the implementation returned no {name!r}")
        verdicts.append(tolerance.judge(name, values[name], refs.oracle[name], refs.baseline[name], dtype))
    return verdicts


def _empty_rows_note(values: dict, refs: References, inputs: Inputs) -> str | None:
    """When the output fails only in query rows with no allowed key, say so."""
    allowed = inputs.allowed()
    row_ok = np.broadcast_to(allowed.any(-1), (allowed.shape[0], inputs.case.q_heads, allowed.shape[2]))
    row_ok = np.swapaxes(row_ok, 1, 2)[..., None]  # [B, Lq, Hq, 1]
    if row_ok.all():
        return None
    keep = lambda x: np.where(row_ok, x, 0.0)
    v = tolerance.judge("out", keep(values["out"]), refs.oracle["out"] * row_ok, keep(refs.baseline["out"]),
                        inputs.case.dtype)
    if v.passed:
        empty = values["out"][np.broadcast_to(~row_ok, values["out"].shape)]
        what = "NaN" if np.isnan(empty).any() else ("0" if np.all(empty == 0) else "non-zero")
        return f"out is right in every row with an allowed key; rows with none give {what} (see probe_empty_rows)"
    return None


def run_one(adapter: Adapter, inputs: Inputs, refs: References) -> Result:
    case = inputs.case
    start = time.perf_counter()
    reason = adapter.unsupported(case)
    if reason:
        return Result(case.name, adapter.name, NOT_SUPPORTED, reason)
    try:
        # A paged cache is forward only (inference): its output is judged.
        prepared = adapter.prepare(inputs, backward=not case.page_size)
        prepared.run()
        values = prepared.results()
    except (NotSupported, NotImplementedError) as e:
        return Result(case.name, adapter.name, NOT_SUPPORTED, f"{e}")
    except Exception as e:  # a crash is a result too, unless the platform cannot run the call
        limit = platform_limitation(e)
        if limit:
            return Result(case.name, adapter.name, NOT_SUPPORTED, limit)
        tb = traceback.format_exc(limit=3)
        return Result(case.name, adapter.name, ERROR, f"{type(e).__name__}: {e}"[:600] + "\n" + tb[-800:])
    seconds = time.perf_counter() - start
    refused = prepared.info.get("not_differentiated")
    verdicts = judge_results(values, refs, case.dtype, forward_only=bool(case.page_size),
                             not_differentiated=refused)
    passed = all(v.passed for v in verdicts)
    result = Result(case.name, adapter.name, PASS if passed else FAIL, verdicts=verdicts,
                    info=dict(prepared.info), seconds=seconds)
    if not passed:
        result.note = _empty_rows_note(values, refs, inputs)
    unjudged = [n for n in refs.oracle if n not in values]
    if refused and unjudged and not case.page_size:
        result.unjudged = f"{', '.join(unjudged)} not judged: {refused}"
    return result


def run_suite(cases: Iterable[Case], adapters: list[Adapter], *,
              progress: Callable | None = None) -> list[Result]:
    """Every case through every adapter. ``progress(case_name, impl_name)`` after each pair."""
    results = []
    for case in cases:
        inputs = make_inputs(case)
        refs = references(inputs)
        for adapter in adapters:
            results.append(run_one(adapter, inputs, refs))
            if progress:
                progress(case.name, adapter.name)
    return results


def is_own(impl: str) -> bool:
    """The library's implementations: held to docs/semantics.md, probes included."""
    return impl.startswith("jax_impl.")


def is_plugin(impl: str) -> bool:
    return ":" in impl


def must_pass(impl: str) -> bool:
    """Case failures of these decide the exit code: the project's own and plug-ins."""
    return is_own(impl) or is_plugin(impl)
