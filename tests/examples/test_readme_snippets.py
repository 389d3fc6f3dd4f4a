"""The README's ```python blocks run as written, in order, in one namespace (CPU, small shapes)."""
import contextlib
import io
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_python_blocks_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    # the quickstart shows its result: the implementation that ran, its distance from the dense
    # computation, and the Flax layer's output shape
    chosen, distance = printed.getvalue().splitlines()[0].split()
    assert chosen in ("cpu", "xla") and 0 <= float(distance) < 1e-5
    assert printed.getvalue().splitlines()[1] == "(2, 16, 32)"
    assert namespace["out"].shape == (2, 128, 8, 64) and np.isfinite(np.asarray(namespace["out"])).all()
    assert namespace["y"].shape == (2, 16, 32)


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README.read_text()
