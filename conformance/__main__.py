"""python -m conformance [--suite quick|full|course|probes] [--impl NAME|module:function ...]
[--case TEXT ...] [--out DIR | --update-reference] [--device cpu|cuda] [--no-probes]

Runs every case of the suite through every implementation, judges outputs and gradients
against the float64 oracle, runs the semantic probes, prints a table and writes Markdown, JSON
and a heat map (with matplotlib) to --out (default ./flash_attention_results/conformance/<device>/). Exit code 1 when a
jax_impl.* implementation or a --impl module:function plug-in fails or errors on a case it
supports, or a jax_impl.* probe contradicts docs/semantics.md; 2 for a bad command line.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from conformance import cases as cases_mod
from conformance import harness, outputs, probes as probes_mod, registry, report


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n\n")[1])
    p.add_argument("--suite", default="quick", choices=sorted(cases_mod.SUITES),
                   help="which cases (default quick: 25 small cases; probes: the probes only)")
    p.add_argument("--impl", action="append", default=None,
                   help="registry name, or module:function for a plug-in (the contract: conformance/README.md); "
                        "repeatable; default: every available one")
    p.add_argument("--out", default=None, type=Path,
                   help="output folder (default ./flash_attention_results/conformance/<device>/)")
    p.add_argument("--update-reference", action="store_true",
                   help="write to the committed reference reports, conformance/results/<device>/ "
                        "(whole suite, every implementation: no --impl, --case or --out)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if JAX sees a GPU")
    p.add_argument("--no-probes", action="store_true", help="skip the semantic probes")
    p.add_argument("--case", action="append", default=None,
                   help="only cases whose name contains this (repeatable)")
    return p.parse_args(argv)


class UsageError(ValueError):
    """A command line that cannot run; reported in one line before any work starts."""


def select_cases(suite: str, selectors: list[str] | None) -> list:
    all_cases = [] if suite == "probes" else cases_mod.get_suite(suite)
    if not selectors:
        return all_cases
    unmatched = [s for s in selectors if not any(s in c.name for c in all_cases)]
    if unmatched:
        raise UsageError(f"--case {unmatched[0]!r} matches no case of suite {suite!r} "
                         f"(cases: {', '.join(c.name for c in all_cases) or 'none'})")
    return [c for c in all_cases if any(s in c.name for s in selectors)]


def output_dir(args, device: str) -> Path:
    if args.update_reference:
        if args.impl or args.case or args.out:
            raise UsageError("--update-reference rewrites the committed report of the whole suite: "
                             "it takes no --impl, --case or --out")
        folder = outputs.reference_dir("conformance", device)
    else:
        folder = args.out or outputs.default_dir("conformance", device)
    return outputs.ensure_writable(folder)


def must_pass_failures(results, probe_rows) -> list[tuple[str, str]]:
    """(impl, case) pairs that decide the exit code: a jax_impl.* or plug-in FAIL or error on a
    case it did not declare unsupported, and a jax_impl.* probe that contradicts docs/semantics.md."""
    failed = sorted({(r.impl, r.case) for r in results if harness.must_pass(r.impl) and harness.claims_failure(r)})
    return failed + sorted({(p.impl, p.probe) for p in probe_rows if harness.is_own(p.impl) and p.conforms is False})


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # every check of the command line before any work starts
        device = args.device or registry.default_device()
        cases = select_cases(args.suite, args.case)
        if args.impl:
            adapters = [registry.get_adapter(name, device) for name in args.impl]
            skipped = {}
        else:
            adapters = registry.available_adapters(device)
            skipped = registry.unavailable_adapters(device)
        out_dir = output_dir(args, device)
    except (registry.UnknownImplementation, registry.PluginError) as e:
        print(f"python -m conformance: error: --impl: {e}", file=sys.stderr)
        return 2
    except (UsageError, outputs.OutputError) as e:
        print(f"python -m conformance: error: {e}", file=sys.stderr)
        return 2

    from tqdm import tqdm
    impls = [a.name for a in adapters]
    with_probes = args.suite == "probes" or not args.no_probes
    n_probes = len(cases_mod.get_suite("probes")) * len(adapters) if with_probes else 0
    start = time.perf_counter()
    bar = tqdm(total=len(cases) * len(adapters) + n_probes, unit="run", dynamic_ncols=True,
               disable=os.environ.get("CONFORMANCE_NO_PROGRESS") == "1")
    if bar.disable:  # a log instead of a bar: a run cut short by a timeout still shows how far it got
        step = lambda case, impl: print(f"[{time.perf_counter() - start:.0f} s] {case} / {impl}", flush=True)
    else:
        step = lambda case, impl: (bar.set_postfix_str(f"{case} / {impl}", refresh=False), bar.update())
    results = harness.run_suite(cases, adapters, progress=step)
    probe_rows = probes_mod.run_probes(adapters, progress=step) if with_probes else []
    bar.close()
    seconds = time.perf_counter() - start

    failed = must_pass_failures(results, probe_rows)
    exit_code = 1 if failed else 0
    command = shlex.join(["python", "-m", "conformance"] + list(sys.argv[1:] if argv is None else argv))
    env = report.environment(device, command)
    md, js, picture = report.write(out_dir, results, probe_rows, cases, impls, env, args.suite, seconds, skipped,
                                   exit_code)
    # the summary last: the probes and the reasons of n.s. cells above it
    if probe_rows:
        print(report.probe_summary(probe_rows) + "\n")
    if cases:
        print(report.terminal_table(results, cases, impls))
    print("\n" + report.wrapped(f"{len(cases)} cases x {len(impls)} implementations in {seconds:.0f} s; "
                               f"report {md}, numbers {js}; " + (f"heat map {picture}" if isinstance(picture, Path)
                                                                  else picture)))
    if failed:
        print(report.wrapped("must-pass failures: " + ", ".join(f"{i} on {c}" for i, c in failed)), file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
