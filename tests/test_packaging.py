"""What `pip install` puts in an environment: the extras shaped by job, and the modules the
distribution installs."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DISTRIBUTION = PYPROJECT["project"]["name"]
# What only the tests need (triton alone is 0.9 GB): the README's first command installs none.
TEST_ONLY = {"triton", "sphinx", "myst-parser", "furo", "flax", "optax", "matplotlib", "pytest",
             "pytest-xdist", "tokamax"}


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower()


def extra_requirements(extra: str, extras: dict | None = None, distribution: str = DISTRIBUTION) -> set[str]:
    """The distributions an extra installs beyond the base, its references to other extras of
    this distribution (``name[a,b]``) followed."""
    extras = PYPROJECT["project"]["optional-dependencies"] if extras is None else extras
    found = set()
    for requirement in extras[extra]:
        name = requirement_name(requirement)
        if name == distribution:
            for inner in re.search(r"\[(.*?)\]", requirement).group(1).split(","):
                found |= extra_requirements(inner.strip(), extras, distribution)
        else:
            found.add(name)
    return found


def readme_install_extras(command_index: int) -> list[str]:
    """The extras of the README's ``command_index``-th ``pip install ... -e ".[...]"``."""
    commands = re.findall(r'^    python3 -m pip install .*?-e "\.\[(.*?)\]"', (ROOT / "README.md").read_text(), re.M)
    return commands[command_index].split(",")


def test_the_readmes_first_command_installs_what_conformance_runs_and_no_test_tool():
    installed = set().union(*(extra_requirements(e) for e in readme_install_extras(0)))
    assert "torch" in installed
    assert installed & TEST_ONLY == set()


def test_the_tests_install_conformance_the_peers_and_their_tools():
    installed = set().union(*(extra_requirements(e) for e in readme_install_extras(1)))
    assert extra_requirements("conformance") | extra_requirements("peers") <= installed
    assert {"triton", "sphinx", "flax", "matplotlib", "pytest-xdist"} <= installed


def test_extra_requirements_follows_references_to_other_extras():
    extras = {"a": ["torch>=2", "dist[b]"], "b": ["flax; python_version < '4'", "dist[c, d]"], "c": ["x"], "d": []}
    assert extra_requirements("a", extras, "dist") == {"torch", "flax", "x"}


def installed_modules() -> dict[str, Path]:
    """Dotted name -> file of every module ``pip install .`` puts in site-packages, found as
    setuptools finds them from pyproject's ``packages.find``."""
    from setuptools import find_namespace_packages, find_packages
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    packages = finder(where=str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ()))
    return {f"{package}.{path.stem}".removesuffix(".__init__"): path
            for package in packages for path in (ROOT / package.replace(".", "/")).glob("*.py")}


def test_the_distribution_installs_no_compile_report_or_estimator():
    modules = installed_modules()
    assert {"jax_impl.flash_attention", "conformance.harness", "benchmarks.measure", "torch_ref"} <= set(modules)
    tools = {path.stem for path in (ROOT / "tools").glob("*.py")} - {"__init__"}
    assert {"compile_report", "mosaic_compile_report", "tpu_compile_report", "tpu_estimate"} <= tools
    installed_tools = [name for name in modules if name.split(".")[0] == "tools" or name.split(".")[-1] in tools]
    assert installed_tools == []


def test_no_installed_module_imports_the_tools():
    import ast
    importers = []
    for name, path in installed_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            imported = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            importers += [f"{name}: {module}" for module in imported if module.split(".")[0] == "tools"]
    assert importers == []
