"""python -m benchmarks --suite sharded: per-device memory and collectives vs device count,
written to the CLI's output folder (8 virtual CPU devices in a subprocess)."""
import json

import pytest

from benchmarks.__main__ import main


def test_sharded_suite_writes_its_table_to_out(tmp_path):
    assert main(["--suite", "sharded", "--device", "cpu", "--seq-lens", "512", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_sharded.json").read_text())
    rows = {(r["sharding"], r["program"], r["devices"]): r for r in report["rows"]}
    assert {n for _, _, n in rows} == {1, 2, 4, 8}
    for program in ("forward", "forward_backward"):
        ring = rows[("sequence", program, 8)]
        assert ring["collectives"]["all-gather"] == 0 and ring["collectives"]["collective-permute"] > 0
        local = rows[("heads", program, 8)]
        assert sum(local["collectives"].values()) == 0  # heads computed locally
        assert ring["per_device_mib"] < rows[("sequence", program, 1)]["per_device_mib"]
    assert "| sequence | forward | 8 |" in (tmp_path / "bench_sharded.md").read_text()


@pytest.mark.parametrize("extra", [["--seq-lens", "256,512"], ["--heads", "2"], ["--impl", "jax.dense"]])
def test_sharded_suite_refuses_options_it_cannot_use(tmp_path, extra, capsys):
    assert main(["--suite", "sharded", "--device", "cpu", "--out", str(tmp_path), *extra]) == 2
    assert "--suite sharded" in capsys.readouterr().err
