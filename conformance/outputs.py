"""Where runs write: a folder the user names, else one under the current directory; the committed
reference reports (inside the source checkout) only when asked to update them."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

DEFAULT_ROOT = Path("flash_attention_results")   # under the current directory; in .gitignore
REPO_ROOT = Path(__file__).resolve().parent.parent


class OutputError(ValueError):
    """An output folder that cannot be used; the message names the option and the cause."""


def default_dir(tool: str, device: str) -> Path:
    """``./flash_attention_results/<tool>/<device>``."""
    return DEFAULT_ROOT / tool / device


def reference_dir(package: str, device: str) -> Path:
    """The committed reference reports, e.g. ``conformance/results/cpu``, in a source checkout."""
    if not (REPO_ROOT / "pyproject.toml").is_file():
        raise OutputError(f"--update-reference needs a source checkout: {package}/results is not in one here "
                          "(an installed package has no reference reports to update); use --out DIR")
    return REPO_ROOT / package / "results" / device


def ensure_writable(folder: Path, option: str = "--out") -> Path:
    """Create ``folder`` and check a file can be written there, before any work starts."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_check_"):
            pass
    except OSError as e:
        raise OutputError(f"{option} {str(folder)!r} is not a writable folder: "
                          f"{e.strerror or type(e).__name__}") from e
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{option} {str(folder)!r} is not a writable folder")
    return folder
