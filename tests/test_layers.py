"""The packages' layers, read from their imports: no circle, no import from a lower layer to a
higher one, no backend importing another backend, and a bounded import chain.

jax_impl, bottom to top (docs/design.md, "Layers"):
  core          the mask rule, the per-tile math, config, dropout and sinks, platform facts, a call's features,
                score and mask functions, block masks, what the Pallas kernels share of a tile
  backends      xla, cpu_kernel, pallas_triton, mosaic_gpu, mosaic_tpu, reference, cudnn: each imports the core only
  table         implementations: which backend can run a call
  distribution  the custom VJP, partitioning under jit, the ring: handed the chosen
                implementation, they never read the table
  arguments     every check of user input
  api           flash_attention, context_parallel
  face          the package's __init__
conformance: the cases and the judging rule at the bottom, adapters above them, the harness,
registry and probes above those, the report and the CLI on top.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

JAX_IMPL_LAYERS = {
    "core": ["masking", "config", "online_softmax", "dropout_sinks", "vma", "platform", "symbolic_zeros",
             "mods", "block_mask", "kernel_tiles", "call_features"],
    "backends": ["xla", "cpu_kernel", "pallas_triton", "mosaic_gpu", "mosaic_tpu", "reference", "cudnn"],
    "table": ["implementations"],
    "distribution": ["ring", "ulysses", "cp_cost", "partitioned", "recompute_vjp"],
    "arguments": ["arguments"],
    "api": ["flash_attention", "context_parallel", "kv_cache"],
    "face": [""],  # jax_impl/__init__.py
}
BACKENDS = JAX_IMPL_LAYERS["backends"]
# Layers that may not import a given lower one: the distribution layer is handed the
# implementation it runs.
JAX_IMPL_SKIPS = {"distribution": "table"}
CONFORMANCE_LAYERS = {
    "inputs": ["cases", "mods", "tolerance", "outputs", "devices"],
    "runs": ["runs", "oracle"],
    "adapters": ["adapters"],
    "harness": ["harness", "plugins"],
    "registry": ["registry", "probes"],
    "report": ["report", "heatmap"],
    "face": ["", "__main__"],
}
LONGEST_CHAIN = 11  # modules, the first and last counted


def modules(package: str) -> dict[str, set[str]]:
    """Every module of ``package`` under ROOT -> the modules of the package it imports (at any
    depth of the file: a function-level import is an edge too)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    graph = {}
    for name, path in found.items():
        edges = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from this module's package
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in found else base)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in found and e != name}
    return graph


def layer_of(module: str, package: str, layers: dict) -> tuple[int, str]:
    """(layer index, unit) of a module: the unit is the layer entry it belongs to (a backend
    package with its submodules is one unit)."""
    rest = module[len(package) + 1:] if module != package else ""
    for index, units in enumerate(layers.values()):
        for unit in units:
            if rest == unit or (unit and rest.startswith(unit + ".")):
                return index, unit
    raise AssertionError(f"{module} is in no layer of this test: place it")


def violations(package: str, layers: dict, backends=(), skips=None) -> list[str]:
    graph = modules(package)
    names = list(layers)
    found = []
    for module, imports in graph.items():
        level, unit = layer_of(module, package, layers)
        for target in imports:
            target_level, target_unit = layer_of(target, package, layers)
            if target_level > level:
                found.append(f"{module} imports {target}, a higher layer")
            elif (skips or {}).get(names[level]) == names[target_level]:
                found.append(f"{module} ({names[level]}) imports {target} ({names[target_level]})")
            elif unit in backends and target_unit in backends and target_unit != unit:
                found.append(f"backend {module} imports backend {target}")
    found += [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    return found


def circles(graph) -> list[list[str]]:
    seen, on_path, found = set(), [], []

    def visit(node):
        if node in on_path:
            found.append(on_path[on_path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for target in sorted(graph[node]):
            visit(target)
        on_path.pop()

    for node in sorted(graph):
        visit(node)
    return found


def longest_chain(graph) -> list[str]:
    """The longest path of imports (the graph has no circle: the test above)."""
    @functools.cache
    def longest(node):
        best = max((longest(t) for t in graph[node]), key=len, default=())
        return (node,) + best

    return list(max((longest(n) for n in graph), key=len))


@pytest.mark.parametrize("package, layers, backends, skips", [
    ("jax_impl", JAX_IMPL_LAYERS, BACKENDS, JAX_IMPL_SKIPS), ("conformance", CONFORMANCE_LAYERS, (), None)])
def test_no_circle_no_upward_import_no_backend_importing_another(package, layers, backends, skips):
    assert violations(package, layers, backends, skips) == []


def test_the_longest_import_chain_in_jax_impl_is_bounded():
    chain = longest_chain(modules("jax_impl"))
    assert len(chain) <= LONGEST_CHAIN, " -> ".join(chain)


def test_the_checks_see_what_they_forbid(tmp_path, monkeypatch):
    """On a package laid out as jax_impl once was (a backend taking a helper from another, the
    API importing a backend, a tool importing the API from inside a kernel package, a circle),
    every rule fires."""
    files = {
        "__init__.py": "from pkg import api\n",
        "masking.py": "",
        "xla.py": "from pkg import masking\ndef host_threads(): ...\n",
        "cpu_kernel/__init__.py": "from pkg.xla import host_threads\n",
        "pallas_triton/__init__.py": "from pkg.pallas_triton import report\n",
        "pallas_triton/report.py": "def f():\n    from pkg.api import attend\n",
        "implementations.py": "from pkg import cpu_kernel, pallas_triton, xla\n",
        "ring.py": "from pkg import implementations\n",
        "partitioned.py": "from pkg import ring\nfrom pkg import recompute_vjp\n",
        "recompute_vjp.py": "from pkg import partitioned\n",
        "api.py": "from pkg import recompute_vjp\nfrom pkg.pallas_triton import report\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    layers = {"core": ["masking"], "backends": ["xla", "cpu_kernel", "pallas_triton"],
              "table": ["implementations"], "distribution": ["ring", "partitioned", "recompute_vjp"],
              "api": ["api"], "face": [""]}
    found = "\n".join(violations("pkg", layers, layers["backends"], JAX_IMPL_SKIPS))
    assert "backend pkg.cpu_kernel imports backend pkg.xla" in found
    assert "pkg.pallas_triton.report imports pkg.api, a higher layer" in found
    assert "pkg.ring (distribution) imports pkg.implementations (table)" in found
    assert "import circle" in found and "pkg.partitioned" in found
