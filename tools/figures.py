"""The conformance figures README.md and docs/results.md quote, written from the committed reports.

    python -m tools.figures            # rewrite every generated block from the committed data
    python -m tools.figures --check    # name each stale block (exit 1); write nothing

A generated block sits between ``<!-- figures: NAME -->`` and ``<!-- /figures -->`` in a page;
its text is a function of the committed reports alone (conformance/results/<device>/
conformance_quick.json), so a page cannot quote a count its data does not hold.
tests/tools/test_figures.py fails when a block is stale.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_REPORT = ROOT / "conformance/results/cpu/conformance_quick.json"
GPU_REPORT = ROOT / "conformance/results/nvidia-h200/conformance_quick.json"
WIDTH = 95  # the pages' prose width
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->\n)(?P<text>.*?)(<!-- /figures -->)", re.S)
# the README names the three implementations a CPU user runs, in the words of its Implementations list
README_IMPLS = {"jax_impl.cpu": "the CPU kernel", "jax_impl.xla": "`xla`",
                "jax_impl.pallas_triton": "the Pallas kernel in the interpreter"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def counts(report: dict, impl: str) -> dict:
    """pass, FAIL, n.s., error of ``impl`` (the report's summary, which the tests hold to its
    results), its worst ratio over the cases it passed (the summary's includes its failures)
    and its failures with their reasons."""
    mine = [r for r in report["results"] if r["impl"] == impl]
    passed = [r["worst_ratio"] for r in mine if r["status"] == "pass" and r["worst_ratio"] is not None]
    found = {status: report["summary"][impl][status] for status in ("pass", "FAIL", "n.s.", "error")}
    return dict(found, worst_pass=max(passed, default=None),
                failures=[(r["case"], r["note"]) for r in mine if r["status"] in ("FAIL", "error")])


def implementations(report: dict) -> list[str]:
    return list(report["summary"])


def caption(report_path: Path, host: str) -> str:
    """The figure's "Data:" line: its files, the host and the versions; no date (the pages say the
    present; the report keeps its date)."""
    env = load(report_path)["environment"]
    rel = "../" + report_path.relative_to(ROOT).as_posix()
    versions = ", ".join(f"{name} {env[name]}" for name in ("jax", "torch") if name in env)
    return (f"Data: [{report_path.name}]({rel}), [report]({rel.removesuffix('.json')}.md): {host}, "
            f"{versions}.\n")


def cpu_table(report: dict) -> str:
    """docs/results.md: one row per implementation of the CPU reference report."""
    rows = [f"{len(report['cases'])} cases on a 2-core CPU:", "",
            "| implementation | pass / FAIL / n.s. | worst error ÷ tolerance of a pass |", "| --- | --- | --- |"]
    for impl in implementations(report):
        c = counts(report, impl)
        worst = "-" if c["worst_pass"] is None else f"{c['worst_pass']:.2f}"
        failed = "".join(f"; FAIL on {case}" + (" (rows with no allowed key only)" if note else "")
                         for case, note in c["failures"])
        rows.append(f"| `{impl}` | {c['pass']} / {c['FAIL'] + c['error']} / {c['n.s.']} | {worst}{failed} |")
    return "\n".join(rows) + "\n\n" + caption(CPU_REPORT, "2-core CPU")


def gpu_sentence(report: dict) -> str:
    """docs/results.md: what the H200 report holds, its case count included."""
    parts = []
    for impl in implementations(report):
        c = counts(report, impl)
        parts.append(f"`{impl}` passes {c['pass']}, fails {c['FAIL'] + c['error']}, {c['n.s.']} not supported"
                     + ("" if c["worst_pass"] is None else f" (worst {c['worst_pass']:.2f})"))
    text = f"On one H200, of the {len(report['cases'])} cases it ran: " + "; ".join(parts) + "."
    return textwrap.fill(text, WIDTH) + "\n" + caption(GPU_REPORT, "one NVIDIA H200")


def readme_brief(cpu: dict, gpu: dict) -> str:
    """README.md's conformance bullet: the CPU user's implementations and the compiled kernel."""
    said = []
    for impl, words in README_IMPLS.items():
        c = counts(cpu, impl)
        rest = ", ".join(f"{n} {what}" for n, what in ((c["FAIL"] + c["error"], "failing"),
                                                     (c["n.s."], "not supported")) if n)
        said.append(f"{words} {c['pass']}" + (f" ({rest})" if rest else ""))
    worst = max(counts(cpu, impl)["worst_pass"] for impl in README_IMPLS)
    compiled = counts(gpu, "jax_impl.pallas_triton")
    text = (f"- **Conformance**: of the quick suite's {len(cpu['cases'])} cases, on a CPU "
            f"{', '.join(said[:-1])} and {said[-1]} pass (worst error ÷ tolerance {worst:.2f}); on one "
            f"H200 the compiled Pallas kernel passes {compiled['pass']} of the {len(gpu['cases'])} it ran "
            f"({compiled['worst_pass']:.2f}).")
    return textwrap.fill(text, WIDTH, subsequent_indent="  ") + "\n"


def blocks() -> dict[tuple[Path, str], str]:
    """(page, block name) -> the block's text from the committed data."""
    cpu, gpu = load(CPU_REPORT), load(GPU_REPORT)
    return {(ROOT / "docs/results.md", "conformance-cpu"): cpu_table(cpu),
            (ROOT / "docs/results.md", "conformance-h200"): gpu_sentence(gpu),
            (ROOT / "README.md", "conformance"): readme_brief(cpu, gpu)}


def rewrite(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s body replaced; a missing block is an error."""
    found = [m for m in BLOCK.finditer(text) if m.group("name") == name]
    if len(found) != 1:
        raise ValueError(f"expected one block <!-- figures: {name} --> ... <!-- /figures -->, found {len(found)}")
    m = found[0]
    return text[:m.start("text")] + body + text[m.end("text"):]


def stale(wanted: dict | None = None) -> list[str]:
    """'page: block' for every generated block whose text is not what the data gives."""
    wanted = blocks() if wanted is None else wanted
    return [f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}: {name}"
            for (page, name), body in wanted.items() if rewrite(page.read_text(), name, body) != page.read_text()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="name each stale block (exit 1), write nothing")
    args = parser.parse_args(argv)
    wanted = blocks()
    outdated = stale(wanted)
    if args.check:
        print("\n".join(f"stale: {b} (python -m tools.figures rewrites it)" for b in outdated) or "every block current")
        return 1 if outdated else 0
    for (page, name), body in wanted.items():
        page.write_text(rewrite(page.read_text(), name, body))
    print("\n".join(f"rewrote {b}" for b in outdated) or "every block current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
