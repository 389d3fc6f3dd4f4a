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
