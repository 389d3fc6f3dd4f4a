"""examples/train_tiny_lm.py as a command: help texts, and it writes under the current directory."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_tiny_lm.py"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_every_option_has_a_help_text(tmp_path):
    run = _run("--help", cwd=tmp_path)
    assert run.returncode == 0
    entries = re.split(r"\n  (?=-)", run.stdout.split("options:", 1)[1])[1:]  # one per option
    helps = {e.split()[0].rstrip(","): " ".join(re.split(r"\S  +|\n", e.strip(), maxsplit=1)[1:]).strip()
             for e in entries}
    for option in ("--steps", "--out", "--update-reference", "--implementation", "--print-every", "--no-progress"):
        assert len(helps.get(option, "")) > 10, (option, helps)


def test_a_run_writes_under_the_current_directory_not_into_the_repository(tmp_path):
    committed = {p: p.stat().st_mtime_ns for p in (REPO / "examples" / "results").iterdir()}
    run = _run("--steps", "3", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "flash_attention_results" / "train_tiny_lm"
    assert sorted(p.name for p in out.iterdir()) == ["tiny_lm_losses.json", "tiny_lm_losses.png"]
    assert {p: p.stat().st_mtime_ns for p in (REPO / "examples" / "results").iterdir()} == committed


def test_an_unwritable_out_fails_in_one_line_before_training(tmp_path):
    (tmp_path / "a_file").write_text("")
    run = _run("--out", "a_file/sub", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == \
        "train_tiny_lm.py: error: --out 'a_file/sub' is not a writable folder: Not a directory"
    assert "documents" not in run.stdout  # no training started
