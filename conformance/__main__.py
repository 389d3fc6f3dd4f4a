"""python -m conformance [--suite quick|full|course|probes] [--impl NAME|module:function ...]
[--out DIR] [--device cpu|cuda] [--no-probes]

Runs every case of the suite through every implementation, judges outputs and gradients
against the float64 oracle, runs the semantic probes, prints a table and writes Markdown and
JSON to --out (default conformance/results/<device>/). Exit code 1 when a jax_impl.*
implementation (or a --impl module:function plug-in) fails or errors on a case it supports,
or a jax_impl.* probe contradicts DESIGN.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from conformance import cases as cases_mod
from conformance import harness, probes as probes_mod, registry, report


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n\n")[1])
    p.add_argument("--suite", default="quick", choices=sorted(cases_mod.SUITES))
    p.add_argument("--impl", action="append", default=None,
                   help="registry name or module:function (repeatable); default: every available one")
    p.add_argument("--out", default=None, help="output folder (default conformance/results/<device>/)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if JAX sees a GPU")
    p.add_argument("--no-probes", action="store_true", help="skip the semantic probes")
    p.add_argument("--case", action="append", default=None, help="only cases whose name contains this")
    return p.parse_args(argv)


def must_pass_failures(results, probe_rows) -> list[tuple[str, str]]:
    """(impl, case) pairs that decide the exit code: a jax_impl.* or plug-in FAIL or error on a
    case it did not declare unsupported, and a jax_impl.* probe that contradicts DESIGN.md."""
    failed = sorted({(r.impl, r.case) for r in results if harness.must_pass(r.impl) and harness.claims_failure(r)})
    return failed + sorted({(p.impl, p.probe) for p in probe_rows if p.conforms is False})


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or registry.default_device()
    if args.impl:
        adapters = [registry.get_adapter(name, device) for name in args.impl]
        skipped = {}
    else:
        adapters = registry.available_adapters(device)
        skipped = {a.name: a.on(device).available() for a in registry.REGISTRY.values()
                   if a.on(device).available() is not None}
    impls = [a.name for a in adapters]
    suite = args.suite
    cases = [] if suite == "probes" else cases_mod.get_suite(suite)
    if args.case:
        cases = [c for c in cases if any(s in c.name for s in args.case)]
    with_probes = suite == "probes" or not args.no_probes
    n_probes = len(cases_mod.get_suite("probes")) * len(adapters) if with_probes else 0

    start = time.perf_counter()
    bar = tqdm(total=len(cases) * len(adapters) + n_probes, unit="run", dynamic_ncols=True,
               disable=os.environ.get("CONFORMANCE_NO_PROGRESS") == "1")
    step = lambda case, impl: (bar.set_postfix_str(f"{case} / {impl}", refresh=False), bar.update())
    results = harness.run_suite(cases, adapters, progress=step)
    probe_rows = probes_mod.run_probes(adapters, progress=step) if with_probes else []
    bar.close()
    seconds = time.perf_counter() - start

    failed = must_pass_failures(results, probe_rows)
    exit_code = 1 if failed else 0
    if cases:
        print(report.terminal_table(results, cases, impls))
    if probe_rows:
        print("\nprobes:")
        for p in probe_rows:
            flag = "" if p.conforms is not False else "  <-- violates DESIGN.md"
            print(f"  {p.probe:26s} {p.impl:24s} {p.observation[:110]}{flag}")
    env = report.environment(device)
    out_dir = Path(args.out) if args.out else Path(__file__).parent / "results" / device
    md, js = report.write(out_dir, results, probe_rows, cases, impls, env, suite, seconds, skipped, exit_code)
    print(f"\n{len(cases)} cases x {len(impls)} implementations in {seconds:.0f} s; report {md}, numbers {js}")
    if failed:
        print("must-pass failures: " + ", ".join(f"{i} on {c}" for i, c in failed), file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
