"""Tables (terminal, Markdown), CSV, JSON and PNG plots of benchmark rows."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import re
from pathlib import Path

from benchmarks import flops as flops_mod
from benchmarks.measure import OK, WRONG, Row
from conformance.report import without_machine_paths

CSV_COLUMNS = [f.name for f in dataclasses.fields(Row)]


# --- environment ----------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """'cpu', or the GPU's name (e.g. 'NVIDIA H200')."""
    if device == "cpu":
        return "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:
        pass
    try:
        import jax
        return jax.devices("gpu")[0].device_kind
    except Exception:
        return "cuda"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def environment(device: str, command: str) -> dict:
    from conformance.report import environment as conformance_environment
    env = conformance_environment(device, command)
    env["device_name"] = device_name(device)
    env["cpu_model"] = cpu_model()
    env["cpu_count"] = os.cpu_count()
    try:
        env["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        env["load_average_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        import torch
        env["torch_threads"] = torch.get_num_threads()
    except Exception:
        pass
    import numpy
    env["numpy"] = numpy.__version__
    for mod in ("triton", "flash_attn", "tokamax", "flax"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            pass
    env["env_vars"] = {k: v for k, v in os.environ.items()
                       if k.startswith(("XLA_", "JAX_", "OMP_", "MKL_", "CUDA_VISIBLE", "TF_CPP_"))}
    return env


# --- formatting -------------------------------------------------------------------------------

def fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def rate_unit(device: str) -> tuple[str, float]:
    return ("TFLOP/s", 1e12) if device == "cuda" else ("GFLOP/s", 1e9)


def status_cell(r: Row) -> str:
    if r.status == OK:
        return "ok"
    if r.status == WRONG:
        return "WRONG"
    return r.status


def group_title(group: tuple) -> str:
    mode, dtype, d, causal, b, h = group
    return f"{mode}, {dtype}, D={d}, {'causal ' + causal if causal != 'none' else 'not causal'}, B={b}, H={h}"


def _table(rows: list[list[str]], markdown: bool) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if markdown:
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
        return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                         + [line(r) for r in rows[1:]])
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))
    return "\n".join([line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]])


def long_rows(rows: list[Row], device: str) -> list[list[str]]:
    unit, scale = rate_unit(device)
    mem_head = "memory (JAX temp | torch/JAX peak extra | RSS peak extra)"
    out = [["L", "impl", "status", "median ms", "IQR ms", "min-max ms", "n", unit, "x manual", "first call ms",
            mem_head, "check: error/tolerance (<1 passes)"]]
    for r in rows:
        mem = " | ".join(flops_mod.binary_size(x) if x is not None else "-" for x in (
            r.jax_temp_bytes, r.torch_peak_extra_bytes if r.framework == "torch" else r.jax_peak_extra_bytes,
            r.rss_peak_extra_bytes))
        timed = r.median_ms is not None
        check = (f"{r.check_worst_ratio:.2f}" if r.check_worst_ratio is not None else "-")
        note = r.reason if r.status not in (OK,) else (f"sdpa={r.sdpa_backend}" if r.sdpa_backend else "")
        out.append([
            str(r.q_len) if r.q_len == r.kv_len else f"{r.q_len}x{r.kv_len}",
            r.impl, status_cell(r),
            fmt_ms(r.median_ms),
            f"{fmt_ms(r.q1_ms)}-{fmt_ms(r.q3_ms)}" if timed else "-",
            f"{fmt_ms(r.min_ms)}-{fmt_ms(r.max_ms)}" if timed else "-",
            str(r.repeats) if timed else "-",
            f"{r.flop_per_s / scale:.3g}" if r.flop_per_s else "-",
            f"{r.speedup_vs_manual:.2f}x" if r.speedup_vs_manual else ("excluded" if r.status == WRONG else "-"),
            fmt_ms(r.first_call_ms),
            mem,
            check + (f"  {note[:90]}" if note else ""),
        ])
    return out


def groups(rows: list[Row]) -> dict[tuple, list[Row]]:
    out: dict[tuple, list[Row]] = {}
    for r in rows:
        out.setdefault(r.group, []).append(r)
    return out


def pivot(rows: list[Row], device: str) -> list[list[str]]:
    """One line per L: median ms (speedup over torch manual) per implementation."""
    impls = list(dict.fromkeys(r.impl for r in rows))
    by = {(r.q_len, r.impl): r for r in rows}
    out = [["L"] + impls]
    for n in sorted({r.q_len for r in rows}):
        line = [str(n)]
        for i in impls:
            r = by.get((n, i))
            if r is None:
                line.append("")
            elif r.median_ms is None:
                line.append(r.status)
            else:
                s = fmt_ms(r.median_ms)
                if r.status == WRONG:
                    s += " WRONG"
                elif r.speedup_vs_manual:
                    s += f" ({r.speedup_vs_manual:.2f}x)"
                line.append(s)
        out.append(line)
    return out


def per_framework(rows: list[Row]) -> list[list[str]]:
    """One line per L: each framework's fastest correct implementation and its speedup."""
    frameworks = list(dict.fromkeys(r.framework for r in rows))
    out = [["L"] + [f"best {fw} (x manual)" for fw in frameworks]]
    for n in sorted({r.q_len for r in rows}):
        line = [str(n)]
        for fw in frameworks:
            ok = [r for r in rows if r.q_len == n and r.framework == fw and r.status == OK and r.median_ms]
            best = min(ok, key=lambda r: r.median_ms, default=None)
            line.append("-" if best is None else f"{best.impl} {fmt_ms(best.median_ms)} ms" +
                        (f" ({best.speedup_vs_manual:.2f}x)" if best.speedup_vs_manual else ""))
        out.append(line)
    return out


TIME_REFERENCE = "torch.sdpa.cudnn"  # the kernel issue 24 measures against (at most 1.1x its time)


def versus_reference(rows: list[Row], reference: str = TIME_REFERENCE) -> list[list[str]]:
    """One line per configuration that ``reference`` timed correctly: each other correct row's
    median over the reference's median (below 1: faster). Empty without such a configuration."""
    base = {r.config_key: r for r in rows if r.impl == reference and r.status == OK and r.median_ms}
    impls = [i for i in dict.fromkeys(r.impl for r in rows) if i != reference]
    out = [["mode", "D", "causal", "B", "H", "L", f"{reference} ms"] + impls]
    for key, b in base.items():
        line = [b.mode, str(b.head_dim), b.causal, str(b.batch), str(b.heads), str(b.q_len), fmt_ms(b.median_ms)]
        by_impl = {r.impl: r for r in rows if r.config_key == key}
        for i in impls:
            r = by_impl.get(i)
            line.append("-" if r is None or r.status != OK or not r.median_ms else f"{r.median_ms / b.median_ms:.2f}")
        out.append(line)
    return out if len(out) > 1 else []


def terminal(rows: list[Row], device: str) -> str:
    parts = []
    for g, rs in groups(rows).items():
        parts.append(f"\n== {group_title(g)}")
        parts.append(_table(long_rows(rs, device), markdown=False))
    return "\n".join(parts)


def theory_markdown(rows: list[Row]) -> str:
    course = flops_mod.theory_table(2, 8, (1024, 2048, 4096, 8192, 16384), ("float16", "bfloat16", "float32"))
    lines = ["One score tensor `[B, H, Lq, Lk]` (theory; a dense implementation holds at least one, its "
             "backward several). For reference, B=2, H=8:", "",
             _table([["L", "fp16", "bf16", "fp32"]] + [[str(t["L"])] + [flops_mod.binary_size(t[d]) for d in
                                                                         ("float16", "bfloat16", "float32")]
                                                        for t in course], markdown=True)]
    ours = sorted({(r.batch, r.heads, r.q_len, r.kv_len, r.dtype, r.score_tensor_bytes) for r in rows})
    if ours:
        lines += ["", "This run's configurations:", "",
                  _table([["B", "H", "Lq", "Lk", "dtype", "one score tensor"]] +
                         [[str(b), str(h), str(q), str(k), dt, flops_mod.binary_size(n)] for b, h, q, k, dt, n in ours],
                         markdown=True)]
    return "\n".join(lines)


def markdown(rows: list[Row], env: dict, suite, device: str, seconds: float, notes: list[str],
             plots: list[str]) -> str:
    unit, _ = rate_unit(device)
    lines = [f"# Benchmark `{suite.name}` on {env.get('device_name')} ({env.get('cpu_model')})", "",
             suite.description, "",
             f"Run time {seconds:.0f} s. python {env.get('python')}, jax {env.get('jax')}, torch {env.get('torch')}, "
             f"{env.get('cpu_count')} CPUs (affinity {env.get('cpu_affinity')}), torch threads "
             f"{env.get('torch_threads')}, load average at start {env.get('load_average_start')}.", "",
             "Method: compile and warm-up excluded (the first call is reported apart); each repeat is one "
             "device-synchronised call; median with the interquartile range and min-max over the repeats "
             f"(n), input sets cycled between repeats; {unit} from useful FLOPs (4*B*H*pairs*D forward, "
             "exact allowed pairs when causal, 3.5x for forward+backward). Every timed result is first judged "
             "against the float64 oracle (conformance's tolerance policy) on one (batch, head) slice: "
             "`check` is error/tolerance (< 1 passes); WRONG rows are flagged and get no speedup. "
             "`x manual`: torch manual attention's median over this one's, same configuration.", ""]
    lines += [f"- {n}" for n in notes]
    ratios = versus_reference(rows)
    if ratios:
        lines += ["", f"## Time over {TIME_REFERENCE}'s", "",
                  f"Each correct row's median over {TIME_REFERENCE}'s median in the same configuration "
                  "and run (below 1: faster; '-': not timed, or not correct):", "",
                  _table(ratios, markdown=True)]
    for p in plots:
        lines += ["", f"![{p}]({p})"]
    for g, rs in groups(rows).items():
        lines += ["", f"## {group_title(g)}", "", "Median ms (speedup over torch manual):", "",
                  _table(pivot(rs, device), markdown=True), "", "Per framework, fastest correct implementation:", "",
                  _table(per_framework(rs), markdown=True), "", "<details><summary>every figure</summary>", "",
                  _table(long_rows(rs, device), markdown=True), "", "</details>"]
    lines += ["", "## Memory theory", "", theory_markdown(rows), ""]
    return "\n".join(lines)


def _json_value(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def write(out_dir: Path, rows: list[Row], env: dict, suite, device: str, seconds: float,
          notes: list[str]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{suite.name}"
    paths = {"csv": out_dir / f"{stem}.csv", "json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else without_machine_paths(v) if isinstance(v, str) else v)
                        for k, v in dataclasses.asdict(r).items()})
    plots = plot(out_dir, stem, rows, device)
    for name, p in plots.items():
        paths[name] = p
    doc = {"suite": suite.name, "description": suite.description, "device": device, "seconds": seconds,
           "environment": env, "notes": notes,
           "method": {"max_repeats": suite.max_repeats, "min_repeats": suite.min_repeats,
                      "measure_budget_s": suite.measure_budget_s, "input_sets": suite.input_sets,
                      "time_budget_s": suite.time_budget_s, "flops": "4*B*H*allowed_pairs*D fwd; x3.5 fwd+bwd",
                      "speedup_baseline": "torch.manual"},
           "theory_score_tensor_course": flops_mod.theory_table(2, 8, (1024, 2048, 4096, 8192, 16384)),
           "rows": [{k: _json_value(v) for k, v in dataclasses.asdict(r).items()} for r in rows]}
    paths["json"].write_text(without_machine_paths(json.dumps(doc, indent=1, default=str)) + "\n")
    paths["md"].write_text(without_machine_paths(
        markdown(rows, env, suite, device, seconds, notes, [p.name for p in plots.values()])))
    return paths


# --- plots ----------------------------------------------------------------------------------

MARKERS = "osD^vP*Xh<>"
LINESTYLES = ("-", "--", "-.", ":")


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def line_styles(impls: list[str], cmap) -> dict[str, dict]:
    """A colour, a marker and a line style per implementation: lines that coincide (e.g. two
    dense JAX programs with the same temp bytes) stay distinguishable."""
    return {impl: {"color": cmap(k % cmap.N), "marker": MARKERS[k % len(MARKERS)],
                   "linestyle": LINESTYLES[k % len(LINESTYLES)], "markersize": (7, 5, 3.5)[k % 3],
                   "markerfacecolor": "none" if k % 2 else cmap(k % cmap.N)}
            for k, impl in enumerate(impls)}


def plot(out_dir: Path, stem: str, rows: list[Row], device: str) -> dict[str, Path]:
    """time vs L (median, with the interquartile range as a band), speedup vs L, memory vs L:
    one panel per group, log-log (memory: symmetric log, so a measured 0 stays on the plot)."""
    if not can_plot():
        return {}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gs = groups(rows)
    if not gs:
        return {}
    impls = list(dict.fromkeys(r.impl for r in rows))
    style = line_styles(impls, plt.get_cmap("tab20" if len(impls) > 10 else "tab10"))
    ncols = min(4, len(gs))
    nrows = math.ceil(len(gs) / ncols)
    out = {}

    def figure(kind, ylabel, values, spread=None, memory=False):
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
        drawn = False
        for ax, (g, rs) in zip(axes.flat, gs.items()):
            for impl in impls:
                pts = sorted((r.q_len, values(r), r) for r in rs if r.impl == impl and values(r) is not None)
                pts = [(x, y, r) for x, y, r in pts if y > 0 or (memory and y == 0)]
                if not pts:
                    continue
                xs, ys, rs_ = zip(*pts)
                wrong = any(r.status == WRONG for r in rs_)
                st = dict(style[impl], linestyle="--" if wrong else style[impl]["linestyle"])
                ax.plot(xs, ys, lw=1.2, label=impl + (" (WRONG)" if wrong else ""), **st)
                if spread is not None:
                    band = [(x, *spread(r)) for x, r in zip(xs, rs_) if spread(r) is not None]
                    if band:
                        bx, lo, hi = zip(*band)
                        ax.fill_between(bx, lo, hi, color=st["color"], alpha=0.18, lw=0)
                drawn = True
            if kind == "memory":
                xs = sorted({r.q_len for r in rs})
                ys = [next(r.score_tensor_bytes for r in rs if r.q_len == x) / 2 ** 20 for x in xs]
                ax.plot(xs, ys, "k:", label="theory: one score tensor")
            if kind == "speedup":
                ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            if memory:  # MiB; a 0 (nothing measured) stays visible, below the smallest positive value
                positive = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
                ax.set_yscale("symlog", linthresh=min([1.0] + positive))
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("log")
            ax.set_title(group_title(g), fontsize=8)
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(gs):]:
            ax.axis("off")
        if not drawn and kind != "memory":
            plt.close(fig)
            return
        fig.tight_layout()
        path = out_dir / f"{stem}_{kind}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        out[kind] = path

    timed = lambda r: r.median_ms if r.status in (OK, WRONG) else None
    iqr = lambda r: (r.q1_ms, r.q3_ms) if timed(r) is not None and r.q1_ms is not None else None
    figure("time", "median ms (band: interquartile range)", timed, spread=iqr)
    figure("speedup", "speedup over torch manual", lambda r: r.speedup_vs_manual)
    mib = lambda x: None if x is None else x / 2 ** 20

    def peak(r):  # the measured peak where there is one, else the compiled temp bytes (JAX)
        for x in (r.torch_peak_extra_bytes, r.jax_peak_extra_bytes, r.rss_peak_extra_bytes, r.jax_temp_bytes):
            if x is not None and x > 0:
                return mib(x)
        return None
    if device == "cpu":
        figure("memory", "MiB: JAX compiled temp bytes (symlog)", lambda r: mib(r.jax_temp_bytes), memory=True)
        figure("rss", "MiB: peak RSS growth during the call (symlog; 0 = reused memory)",
               lambda r: mib(r.rss_peak_extra_bytes), memory=True)
    else:
        figure("memory", "MiB: peak additional (torch / JAX device; symlog)", peak, memory=True)
        figure("temp", "MiB: JAX compiled temp bytes (symlog)", lambda r: mib(r.jax_temp_bytes), memory=True)
    return out
