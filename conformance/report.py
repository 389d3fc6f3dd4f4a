"""Terminal table, JSON of every number, Markdown report."""
from __future__ import annotations

import json
import os
import platform
import site
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from conformance import heatmap, tolerance
from conformance.cases import Case
from conformance.outputs import REPO_ROOT
from conformance.harness import ERROR, FAIL, NOT_SUPPORTED, PASS, Result
from conformance.probes import EXPECTED, QUESTIONS, ProbeRow


def without_machine_paths(text: str) -> str:
    """``text`` with this machine's folders replaced by portable names (repository-relative,
    ``<site-packages>``, ``<python>``, ``<tmp>``, ``~``): reports are shared and committed."""
    folders = {str(REPO_ROOT) + os.sep: "", os.getcwd() + os.sep: "./", str(Path.home()): "~"}
    folders.update({p: "<site-packages>" for p in site.getsitepackages() + [site.getusersitepackages()]})
    folders.update({sys.prefix: "<python>", sys.base_prefix: "<python>", tempfile.gettempdir() + os.sep: "<tmp>/"})
    for folder in sorted(folders, key=len, reverse=True):  # the most specific first
        if len(folder) > 1:
            text = text.replace(folder, folders[folder])
    return text


def environment(device: str, command: str = "python -m conformance") -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "device": device,
           "command": without_machine_paths(command), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        import jax
        import jaxlib
        env.update(jax=jax.__version__, jaxlib=jaxlib.__version__,
                   jax_devices=", ".join(str(d.device_kind) for d in jax.devices()))
    except Exception as e:  # report what is missing instead of failing
        env["jax"] = f"unavailable ({type(e).__name__})"
    try:
        import torch
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["torch_cuda_device"] = torch.cuda.get_device_name()
    except Exception as e:
        env["torch"] = f"unavailable ({type(e).__name__})"
    return env


RATIO_LEGEND = ("pass/FAIL x = the worst error / tolerance over out, dq, dk, dv (and dbias, and the mods' "
                "aux gradients): below 1 passes; * = wrong only in query rows with no allowed key; "
                "° = some gradients not judged (the implementation refuses them; the report says which); "
                "n.s. = not supported")


def cell(r: Result, footnote: int | None = None) -> str:
    mark = "°" if r.unjudged else ""
    if r.status == PASS:
        return f"pass {r.worst_ratio:.2f}" + mark
    if r.status == FAIL:
        return f"FAIL {r.worst_ratio:.3g}" + ("*" if r.note else "") + mark
    return r.status + (f" [{footnote}]" if footnote else "")


def short_reason(r: Result) -> str:
    """The first line of why a cell is an error or n.s., whole: the terminal wraps it."""
    return r.reason.splitlines()[0] if r.reason else ""


def failure_reason(r: Result) -> str:
    """Why a cell is FAIL (each output past its tolerance; where, when only in rows with no
    allowed key) or error (the first line of the error)."""
    if r.status != FAIL:
        return short_reason(r)
    parts = ", ".join(f"{v.name}: err {v.error:.3g} / tol {v.tolerance:.3g} (baseline {v.baseline_error:.3g}, "
                      f"rel {v.relative_norm:.2g})" for v in r.verdicts if not v.passed)
    return parts + (f". {r.note}" if r.note else "")


def footnotes(results: list[Result]) -> dict[tuple[str, str], int]:
    """(impl, reason) -> footnote number, for every error and n.s. cell."""
    numbers: dict[tuple[str, str], int] = {}
    for r in results:
        if r.status in (ERROR, NOT_SUPPORTED):
            numbers.setdefault((r.impl, short_reason(r)), len(numbers) + 1)
    return numbers


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows[1:]])


def _grid(results: list[Result], cases: list[Case], impls: list[str], notes: dict | None = None):
    by = {(r.case, r.impl): r for r in results}
    notes = notes or {}

    def text(case, impl):
        r = by.get((case, impl))
        return "" if r is None else cell(r, notes.get((r.impl, short_reason(r))))
    return [["case"] + impls] + [[c.name] + [text(c.name, i) for i in impls] for c in cases]


TERMINAL_WIDTH = 120


def wrapped(text: str, first: str = "", rest: str = "    ") -> str:
    """``text`` folded at word boundaries to the terminal width, its lines after the first
    indented by ``rest``."""
    return textwrap.fill(text, TERMINAL_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def _summary_rows(results: list[Result], impls: list[str]) -> list[list[str]]:
    rows = [["implementation", "pass", "FAIL", "n.s.", "error", "worst ratio (case)"]]
    for impl, s in summary(results, impls).items():
        worst = "-" if s["worst_ratio"] is None else f"{s['worst_ratio']:.2f} ({s['worst_case']})"
        rows.append([impl, str(s["pass"]), str(s["FAIL"]), str(s["n.s."]), str(s["error"]), worst])
    return rows


def terminal_table(results, cases, impls) -> str:
    """What a terminal of 120 columns shows, ending with the summary: the legend and why each
    error or n.s. cell is one; then the grid of cases by implementations where it fits, else one
    row per implementation (the grid is in the Markdown report); then each FAIL and error with
    its reason."""
    notes = footnotes(results)
    lines = [wrapped(RATIO_LEGEND)]
    lines += [wrapped(reason if reason.startswith(impl) else f"{impl}: {reason}", f"  [{n}] ", "      ")
              for (impl, reason), n in notes.items()]
    grid = _table(_grid(results, cases, impls, notes))
    if max(map(len, grid.splitlines())) <= TERMINAL_WIDTH:
        lines += ["", grid]
    else:
        lines += ["", wrapped("The grid of cases by implementations: the report below."),
                  "", _table(_summary_rows(results, impls))]
    bad = [r for r in results if r.status in (FAIL, ERROR)]
    if bad:
        lines += [""] + [wrapped(f"{r.status} {r.impl} on {r.case}: {failure_reason(r)}", "  ", "      ")
                         for r in bad]
    return "\n".join(lines)


def probe_summary(probes: list[ProbeRow]) -> str:
    """The probes in a few lines: how many observations follow docs/semantics.md, and each that
    does not (a jax_impl.* one violates it; the others are only observed). The report has them all."""
    observed = [p for p in probes if not p.observation.startswith(("n.s.", "n/a"))]
    differ = [p for p in observed if p.conforms is False
              or (p.conforms is None and not p.observation.startswith(EXPECTED.get(p.probe, "")))]
    head = (f"probes: {len(observed) - len(differ)} of {len(observed)} observations as docs/semantics.md says"
            f"{', the others below' if differ else ''}; {len(probes) - len(observed)} not run. The report has "
            "each one; only jax_impl.* probes set the exit code.")
    return "\n".join([wrapped(head)] + [wrapped(f"{p.probe} {p.impl}: {p.observation}  <-- {probe_verdict(p)}",
                                               "  ", "      ") for p in differ])


def summary(results: list[Result], impls: list[str]) -> dict:
    out = {}
    for impl in impls:
        mine = [r for r in results if r.impl == impl]
        judged = [r for r in mine if r.verdicts]
        worst = max(judged, key=lambda r: r.worst_ratio, default=None)
        out[impl] = {
            "pass": sum(r.status == PASS for r in mine), "FAIL": sum(r.status == FAIL for r in mine),
            "n.s.": sum(r.status == NOT_SUPPORTED for r in mine), "error": sum(r.status == ERROR for r in mine),
            "worst_ratio": None if worst is None else worst.worst_ratio,
            "worst_case": None if worst is None else f"{worst.case} ({worst.worst.name})",
            "worst_relative_norm": max((v.relative_norm for r in judged for v in r.verdicts), default=None),
        }
    return out


def _fmt(x):
    return "-" if x is None else f"{x:.3g}"


def markdown(results, probes: list[ProbeRow], cases, impls, env: dict, suite: str, seconds: float,
             skipped: dict[str, str], heatmap_file: str | None = None) -> str:
    """The report; ``heatmap_file``: the heat map's file name beside it, shown under the grid."""
    lines = [f"# Conformance report: suite `{suite}` on {env['device']}", ""]
    policy = " ".join((tolerance.__doc__ or "").split())
    lines += ["## Tolerance policy", "",
              f"From `conformance/tolerance.py`: {policy} (factors: out {tolerance.OUTPUT_FACTOR:g}, "
              f"gradients {tolerance.GRADIENT_FACTOR:g}.)", "",
              "The oracle is `torch_ref.manual_attention` in float64 on the CPU, on the same input bytes; the "
              "plain same-dtype implementation is the same function run in the case dtype on the CPU. "
              "Gradients are a vjp with one random cotangent per case, never `.sum()`. A cell shows the worst "
              "error / tolerance ratio over out and all gradients (below 1 passes); `*` marks a failure "
              "confined to query rows with no allowed key. `n.s.` = not supported (reasons below).", "",
              "The semantics the probes compare with are those of docs/semantics.md in the repository.", ""]
    lines += ["## Environment", ""] + [f"- {k}: `{v}`" for k, v in env.items()] + \
        [f"- wall time: {seconds:.0f} s", ""]
    if skipped:
        lines += ["Implementations not run on this machine: " +
                  "; ".join(f"`{k}` ({v})" for k, v in skipped.items()), ""]
    lines += ["## Summary", "", "| implementation | pass | FAIL | n.s. | error | worst ratio (case) | worst relative norm |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for impl, s in summary(results, impls).items():
        lines.append(f"| `{impl}` | {s['pass']} | {s['FAIL']} | {s['n.s.']} | {s['error']} | "
                     f"{_fmt(s['worst_ratio'])} ({s['worst_case'] or '-'}) | {_fmt(s['worst_relative_norm'])} |")
    grid = _grid(results, cases, impls)
    lines += ["", "## Results (worst error / tolerance)", "",
              "| " + " | ".join(grid[0]) + " |", "|" + " --- |" * len(grid[0])]
    lines += ["| " + " | ".join(row) + " |" for row in grid[1:]]
    if heatmap_file:
        lines += ["", f"![worst error / tolerance per case and implementation]({heatmap_file})"]
    lines += ["", "## Cases", "", "| case | shape and features | SDPA auto ran |", "| --- | --- | --- |"]
    by = {(r.case, r.impl): r for r in results}
    for c in cases:
        auto = by.get((c.name, "torch.sdpa.auto"))
        ran = (auto.info.get("sdpa_backend") if auto and auto.info else None) or "-"
        lines.append(f"| {c.name} | {c.describe()} | {ran} |")
    bad = [r for r in results if r.status in (FAIL, ERROR)]
    if bad:
        lines += ["", "## Failures and errors", ""]
        lines += [f"- `{r.impl}` on `{r.case}`: {failure_reason(r)}" for r in bad]
    partial = [r for r in results if r.unjudged]
    if partial:
        lines += ["", "## Gradients not judged (°)", ""]
        reasons = {}
        for r in partial:
            reasons.setdefault((r.impl, r.unjudged), []).append(r.case)
        for (impl, why), which in reasons.items():
            lines.append(f"- `{impl}`: {why} ({len(which)} cases)")
    ns = [r for r in results if r.status == NOT_SUPPORTED]
    if ns:
        lines += ["", "## Not supported (reasons)", ""]
        reasons: dict = {}
        for r in ns:
            reasons.setdefault((r.impl, short_reason(r)), []).append(r.case)
        for (impl, reason), which in reasons.items():
            lines.append(f"- `{impl}`: {reason} ({len(which)} cases)")
    if probes:
        lines += ["", "## Semantic probes", "",
                  "Observations of what each framework does. jax_impl.* must follow docs/semantics.md "
                  "(expected column); a plug-in's differences are marked but never set the exit code; "
                  "the others are not judged.", ""]
        probe_names = list(dict.fromkeys(p.probe for p in probes))
        probe_impls = list(dict.fromkeys(p.impl for p in probes))
        by_p = {(p.probe, p.impl): p for p in probes}
        lines += ["| probe | question | docs/semantics.md | " + " | ".join(probe_impls) + " |",
                  "|" + " --- |" * (3 + len(probe_impls))]
        for name in probe_names:
            cells = []
            for impl in probe_impls:
                p = by_p.get((name, impl))
                text = "" if p is None else p.observation.replace("|", "/")
                if p is not None and p.conforms is False:
                    text = f"**{text} ({probe_verdict(p)})**"
                cells.append(text)
            lines.append(f"| {name} | {QUESTIONS.get(name, '')} | {EXPECTED.get(name, '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def probe_verdict(p: ProbeRow) -> str:
    if p.impl.startswith("jax_impl."):
        return "violates docs/semantics.md"
    return "differs from docs/semantics.md; reported, not judged"


def write(out_dir: Path, results, probes, cases, impls, env, suite, seconds, skipped,
          exit_code) -> tuple[Path, Path, Path | str]:
    """Write the JSON, the heat map (where matplotlib is installed) and the Markdown report;
    return their paths, the heat map's or why there is none."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"suite": suite, "environment": env, "seconds": seconds, "exit_code": exit_code,
            "tolerance": {"output_factor": tolerance.OUTPUT_FACTOR, "gradient_factor": tolerance.GRADIENT_FACTOR,
                          "relative_floor": getattr(tolerance, "RELATIVE_FLOOR", None)},
            "skipped_implementations": skipped,
            "cases": [dict(c.__dict__, description=c.describe()) for c in cases],
            "summary": summary(results, impls),
            "results": [r.to_json() for r in results],
            "probes": [p.to_json() for p in probes]}
    json_path = out_dir / f"conformance_{suite}.json"
    md_path = out_dir / f"conformance_{suite}.md"
    json_path.write_text(without_machine_paths(json.dumps(data, indent=1, default=str)) + "\n")
    picture: Path | str = out_dir / f"conformance_{suite}_heatmap.png"
    if not cases:
        picture = "no heat map: no cases"
    elif not heatmap.can_draw():
        picture = heatmap.MISSING_MATPLOTLIB
    if isinstance(picture, str):
        (out_dir / f"conformance_{suite}_heatmap.png").unlink(missing_ok=True)  # not an older run's
    else:
        heatmap.write(picture, results, [c.name for c in cases], impls, f"suite {suite} on {env['device']}")
    md_path.write_text(without_machine_paths(markdown(results, probes, cases, impls, env, suite, seconds, skipped,
                                                      None if isinstance(picture, str) else picture.name)))
    return md_path, json_path, picture
