"""python -m benchmarks [--suite quick|course|sweep|gpu|gpu_large|mosaic_tiles|mosaic_dq|mosaic_pack|sharded|dropout|cpu|decode|masks]
[--impl NAME|module:function ...]
[--out DIR | --update-reference] [--device cpu|cuda]

Times every implementation of the registry (conformance.registry) on the suite's
configurations, after checking each result against the float64 oracle; writes a terminal
table, CSV, JSON, Markdown and PNG plots to --out (default
./flash_attention_results/benchmarks/<device>/, the device being "cpu" or the GPU's name
slugified, e.g. nvidia-h200). Exit code 2 for a bad command line, before any work starts.
A suite with a runner (``--suite sharded``, ``--suite dropout``, ``--suite cpu``, ``--suite masks``) measures on its own: its runner
writes its own files to the same folder.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import measure as measure_mod, report, suites
from benchmarks.measure import OOM, SKIPPED, INTERPRET_REASON, Options, ReferenceCache
from conformance import outputs, registry
from conformance.adapters.base import has_module


def share_the_gpu_with_torch() -> None:
    """Before JAX starts: no 75% preallocation and a capped pool, so JAX and torch share one
    GPU and each side's out-of-memory is a recorded result. Variables already set win."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")


class UsageError(ValueError):
    """A command line that cannot run; reported in one line before any work starts."""


def positive_ints(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UsageError(f"{option} {text!r} must be comma-separated positive integers, e.g. 512,1024")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    p.add_argument("--suite", default="quick", choices=sorted(suites.SUITES))
    p.add_argument("--impl", action="extend", nargs="+", default=None,
                   help="registry name or module:function (repeatable); default: the suite's list, else every "
                        "available one (on CPU without jax_impl.pallas_triton: interpret mode is not a benchmark)")
    p.add_argument("--out", default=None, type=Path,
                   help="output folder (default ./flash_attention_results/benchmarks/<device>/)")
    p.add_argument("--update-reference", action="store_true",
                   help="write to the committed reference results, benchmarks/results/<device>/ (no --out)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if JAX sees a GPU")
    p.add_argument("--seq-lens", default=None,
                   help="comma-separated lengths replacing the suite's (e.g. 128,256)")
    p.add_argument("--heads", type=int, default=None, help="replace the suite's head count")
    p.add_argument("--repeats", type=int, default=None, help="at most this many timed repeats (default: the suite's)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; measurements after it are recorded as skipped (default: the suite's)")
    p.add_argument("--no-check", action="store_true", help="skip the float64-oracle check (rows say 'not checked')")
    p.add_argument("--baseline", default="torch.manual", help="speedups are over this implementation")
    p.add_argument("--devices", default=None,
                   help="--suite sharded only: comma-separated device counts, powers of two "
                        "(default 1,2,4,8)")
    return p.parse_args(argv)


def check_numbers(args) -> None:
    if args.seq_lens is not None:
        args.seq_lens = positive_ints("--seq-lens", args.seq_lens)
    if args.devices is not None:
        args.devices = positive_ints("--devices", args.devices)
    for option in ("heads", "repeats"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UsageError(f"--{option} {value} must be at least 1")


def _enable_compile_cache():
    """Each input set gets its own Prepared (its own jit): a per-process compilation cache turns
    the 2nd..nth compile of the same program into a load. Fresh per run, so first-call and
    prepare times stay honest; removed when the process ends. -> its folder (None: no cache)."""
    try:
        import jax
        path = tempfile.mkdtemp(prefix="bench_jax_cache_")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        return path
    except Exception:
        return None


def select(suite, args, device):
    """(adapters, allow interpret mode, notes). Implementations the user names must be able to
    run here (else UsageError); those a suite lists but this machine lacks are left out, with a note."""
    notes = []
    if args.impl:
        adapters = []
        for name in args.impl:
            try:
                adapter = registry.get_adapter(name, device)
            except (registry.UnknownImplementation, registry.PluginError) as e:
                raise UsageError(f"--impl: {e}") from e
            why = adapter.available()
            if why:
                raise UsageError(f"--impl {name}: cannot run on {device}: {why}")
            adapters.append(adapter)
        opts_interpret = any(a.name == "jax_impl.pallas_triton" for a in adapters)
    else:
        opts_interpret = False
        names = suite.impls.get(device)
        if names:
            listed = [registry.get_adapter(n, device) for n in names]
            adapters = [a for a in listed if a.available() is None]
            notes += [f"{a.name} left out: {a.available()}" for a in listed if a.available() is not None]
        else:
            adapters = [a for a in registry.available_adapters(device)
                        if not (device == "cpu" and a.name == "jax_impl.pallas_triton")]
            notes += [f"{n}: {why}" for n, why in registry.unavailable_adapters(device).items()]
        if device == "cpu":
            notes.append(f"jax_impl.pallas_triton not timed: {INTERPRET_REASON}")
    return adapters, opts_interpret, notes


def with_overrides(suite, args):
    configs = list(suite.configs)
    if args.seq_lens or args.heads:
        lens = list(args.seq_lens) if args.seq_lens else None
        new = []
        for c in configs:
            shape = c.shape
            if args.heads:
                shape = dataclasses.replace(shape, heads=args.heads)
            new.append(dataclasses.replace(c, shape=shape))
        if lens is not None:  # rebuild each group over the given lengths
            seen, rebuilt = set(), []
            for c in new:
                g = c.group
                if g in seen:
                    continue
                seen.add(g)
                rebuilt += [dataclasses.replace(c, shape=dataclasses.replace(c.shape, seq_len=n)) for n in lens]
            new = rebuilt
        configs = new
    kw = {"configs": tuple(configs)}
    if args.repeats:
        kw.update(max_repeats=args.repeats, min_repeats=min(suite.min_repeats, args.repeats))
    if args.time_budget is not None:
        kw["time_budget_s"] = args.time_budget
    return dataclasses.replace(suite, **kw)


def run(suite, adapters, device, *, check=True, allow_interpret=False, baseline="torch.manual",
        progress=True) -> tuple[list, float, list[str]]:
    """Every configuration through every adapter; rows with statuses, speedups added."""
    opts = Options(max_repeats=suite.max_repeats, min_repeats=suite.min_repeats,
                   measure_budget_s=suite.measure_budget_s, input_sets=suite.input_sets, check=check,
                   allow_interpret=allow_interpret)
    refs = ReferenceCache() if check else None
    rows, oom_at, notes = [], {}, []
    start = time.perf_counter()
    from tqdm import tqdm
    bar = tqdm(total=len(suite.configs) * len(adapters), unit="run", dynamic_ncols=True,
               disable=not progress or os.environ.get("BENCH_NO_PROGRESS") == "1")
    skipped_budget = 0
    for config in suite.configs:
        for adapter in adapters:
            bar.set_postfix_str(f"L={config.shape.seq_len} {config.mode} {adapter.name}", refresh=False)
            frontier = oom_at.get((adapter.name, config.group))
            if suite.time_budget_s is not None and time.perf_counter() - start > suite.time_budget_s:
                row = measure_mod.new_row(adapter, config)
                row.status, row.reason = SKIPPED, f"time budget of {suite.time_budget_s:.0f} s spent"
                skipped_budget += 1
            elif frontier is not None and config.shape.seq_len > frontier:
                row = measure_mod.new_row(adapter, config)
                row.status, row.reason = OOM, f"not run: out of memory already at L={frontier}"
            else:
                row = measure_mod.measure(adapter, config, refs, opts)
                if row.status == OOM:
                    oom_at[(adapter.name, config.group)] = min(config.shape.seq_len, frontier or 1 << 62)
            rows.append(row)
            bar.update()
    bar.close()
    measure_mod.add_speedups(rows, baseline)
    seconds = time.perf_counter() - start
    if refs is not None:
        notes.append(f"float64 oracle + same-dtype baseline (one slice per configuration): {refs.seconds:.0f} s of the run")
    if skipped_budget:
        notes.append(f"{skipped_budget} measurements skipped: the time budget of {suite.time_budget_s:.0f} s was spent")
    return rows, seconds, notes


def output_dir(args, device: str) -> Path:
    device_folder = report.slug(report.device_name(device))
    if args.update_reference:
        if args.out:
            raise UsageError("--update-reference writes benchmarks/results/<device>/: it takes no --out")
        folder = outputs.reference_dir("benchmarks", device_folder)
    else:
        folder = args.out or outputs.default_dir("benchmarks", device_folder)
    return outputs.ensure_writable(folder)


def run_runner(suite, args, device: str) -> int:
    """A suite whose runner module replaces the timing run (no implementations, no oracle)."""
    import importlib
    runner = importlib.import_module(suite.runner)
    takes = getattr(runner, "CLI_OPTIONS", ())  # e.g. ("repeats", "time_budget"): passed on as keywords
    given = {option: getattr(args, option) for option in ("impl", "heads", "repeats", "time_budget")
             if getattr(args, option) is not None}
    if set(given) - set(takes):
        raise UsageError(f"--suite {suite.name} has its own runner: it takes only "
                         "--out, --update-reference, --device, one --seq-lens value, "
                         "(sharded) --devices and (masks) --repeats, --time-budget")
    lengths = args.seq_lens or ()
    if len(lengths) > 1:
        raise UsageError(f"--suite {suite.name} takes one --seq-lens value (the fixed L); got {lengths}")
    extra = dict(given)
    if args.devices is not None:
        if not hasattr(runner, "check_devices"):
            raise UsageError(f"--devices is taken only by --suite sharded, not --suite {suite.name}")
        try:
            extra["devices"] = runner.check_devices(args.devices, device)
        except ValueError as e:
            raise UsageError(str(e)) from None
    out_dir = output_dir(args, device)
    paths = runner.run_suite(out_dir, device, *lengths, **extra)
    print(f"--suite {suite.name}: " + ", ".join(str(p) for p in paths))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    share_the_gpu_with_torch()
    try:  # every check of the command line before any work starts
        check_numbers(args)
        device = args.device or registry.default_device()
        suite = with_overrides(suites.get_suite(args.suite), args)
        if suite.runner:
            return run_runner(suite, args, device)
        if args.devices is not None:
            raise UsageError(f"--devices is taken only by --suite sharded, not --suite {suite.name}")
        adapters, allow_interpret, notes = select(suite, args, device)
        if not args.no_check and not has_module("torch"):
            raise UsageError("the float64-oracle check needs torch (pip install torch); "
                             "--no-check times without checking")
        out_dir = output_dir(args, device)
    except (UsageError, outputs.OutputError) as e:
        print(f"python -m benchmarks: error: {e}", file=sys.stderr)
        return 2
    if not any(a.name == args.baseline for a in adapters):
        notes.append(f"no speedups: the baseline {args.baseline} is not among the implementations run")
    if not report.can_plot():
        notes.append("no PNG plots: matplotlib is not installed (pip install matplotlib, or the 'plots' extra)")
    _enable_compile_cache()
    env = report.environment(device, shlex.join(["python", "-m", "benchmarks"] +
                                                list(sys.argv[1:] if argv is None else argv)))
    rows, seconds, run_notes = run(suite, adapters, device, check=not args.no_check,
                                   allow_interpret=allow_interpret, baseline=args.baseline)
    notes += run_notes
    if suite.max_repeats > suite.min_repeats:
        notes.append(f"repeats: about {suite.measure_budget_s:g} s of timed calls per measurement, "
                     f"between {suite.min_repeats} and {suite.max_repeats} (fewer at large L)")
    if device == "cpu":
        notes.append("CPU memory: JAX's compiled temp bytes (XLA memory_analysis) and, for every framework, the "
                     "process's peak RSS growth during the first call (/proc clear_refs + VmHWM; memory reused "
                     "from an allocator's free lists does not show). Device peaks are CUDA-only.")
        notes.append("CPU timings are shared-machine numbers: see load_average_start; spreads are in the tables")
    try:
        env["load_average_end"] = os.getloadavg()
    except OSError:
        pass
    print(report.terminal(rows, device))
    paths = report.write(out_dir, rows, env, suite, device, seconds, notes)
    for n in notes:
        print("note:", n)
    print(f"\n{len(suite.configs)} configurations x {len(adapters)} implementations in {seconds:.0f} s; "
          + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
