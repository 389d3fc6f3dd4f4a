"""The C++ kernel's headers (jax_impl/cpu_kernel/*.h) stand alone: each compiles by itself
(it includes what it uses), has an include guard, includes nothing inside a namespace, and no
two include each other through a loop; a failed check names the header it is in; the package
data ships every header that build.py hashes."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from jax_impl.cpu_kernel import build

KERNEL_DIR = build.SOURCE.parent
HEADERS = sorted(KERNEL_DIR.glob("*.h"))
ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

needs_compiler = pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler")


def _local_includes(header: Path) -> list[str]:
    return INCLUDE.findall(header.read_text())


def test_the_include_graph_has_no_loop_and_names_only_existing_headers():
    graph = {h.name: _local_includes(h) for h in HEADERS}
    for name, includes in graph.items():
        assert set(includes) <= set(graph), f"{name} includes a header not here: {includes}"
    done, active = set(), []

    def visit(name):
        assert name not in active, f"include loop: {' -> '.join(active + [name])}"
        if name in done:
            return
        active.append(name)
        for child in graph[name]:
            visit(child)
        active.pop()
        done.add(name)

    for name in graph:
        visit(name)


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.name)
def test_a_header_has_a_guard_and_includes_nothing_inside_a_namespace(header):
    text = header.read_text()
    guard = re.search(r"^#ifndef (\w+)\n#define \1$", text, re.M)
    assert guard, f"{header.name}: no include guard"
    opened = text.find("namespace flash_cpu {")
    if opened >= 0:
        assert "#include" not in text[opened:], f"{header.name}: #include inside the namespace"


@needs_compiler
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.name)
def test_each_header_compiles_alone(header, tmp_path):
    source = tmp_path / "one.cc"
    source.write_text(f'#include "{header.name}"\n#include "{header.name}"\n')  # twice: the guard
    result = subprocess.run([build._compiler(), "-std=c++17", f"-march={build.MARCH}", "-fsyntax-only",
                             f"-I{KERNEL_DIR}", str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@needs_compiler
def test_a_failed_check_names_the_header_it_is_in(tmp_path):
    """FLASH_CPU_CHECK's message carries __FILE__: a broken invariant in mod_program.h (a row
    outside the tile its diagonal registers hold) is reported there, not in another header."""
    source = tmp_path / "check.cc"
    source.write_text('#include "mod_program.h"\n'
                      "int main() {\n"
                      "  flash_cpu::ModRegisters r;\n"
                      "  r.tile_last = 3; r.tile_rows = 1; r.diagonal_lanes = 16;\n"
                      "  r.SetRow(0, 16);  // offset 3 lies outside a one-row tile\n"
                      "}\n")
    binary = tmp_path / "check"
    result = subprocess.run([build._compiler(), "-std=c++17", "-DFLASH_CPU_CHECKS", f"-I{KERNEL_DIR}",
                             str(source), "-o", str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True)
    assert run.returncode != 0
    assert re.search(r"mod_program\.h:\d+: check failed: offset >= 0", run.stderr), run.stderr


def test_the_package_data_ships_every_header_build_hashes():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in data["jax_impl"] if pattern.startswith("cpu_kernel/")
               for p in (ROOT / "jax_impl").glob(pattern)}
    assert set(build.HEADERS) | {build.SOURCE} <= shipped
    assert set(build.HEADERS) == set(HEADERS)
