"""python -m benchmarks --suite sharded: per-device memory and collectives vs device count,
written to the CLI's output folder (8 virtual CPU devices in a subprocess). The test measures
1 and 8 devices only (``--devices 1,8``): 2 and 4 compile the same programs on smaller meshes
and cost a minute of CI."""
import json

import pytest

from benchmarks.__main__ import main


def test_sharded_suite_writes_its_table_to_out(tmp_path):
    assert main(["--suite", "sharded", "--device", "cpu", "--seq-lens", "512", "--devices", "8,1",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_sharded.json").read_text())
    rows = {(r["sharding"], r["program"], r["devices"]): r for r in report["rows"]}
    assert {n for _, _, n in rows} == {1, 8}
    for program in ("forward", "forward_backward"):
        ring = rows[("sequence ring", program, 8)]
        assert ring["collectives"]["all-gather"] == 0 and ring["collectives"]["collective-permute"] > 0
        a2a = rows[("sequence all_to_all", program, 8)]
        assert a2a["collectives"]["all-gather"] == 0 and a2a["collectives"]["all-to-all"] > 0
        hybrid = rows[("sequence hybrid (2 x N/2)", program, 8)]
        assert hybrid["collectives"]["all-gather"] == 0 and hybrid["collectives"]["all-to-all"] > 0
        assert hybrid["collectives"]["collective-permute"] > 0
        local = rows[("heads", program, 8)]
        assert sum(local["collectives"].values()) == 0  # heads computed locally
        for r in (ring, a2a, hybrid):
            assert r["per_device_mib"] < rows[("sequence", program, 1)]["per_device_mib"]
    # H=8 over 8 devices: the cost model picks the all-to-all, and says how many bytes.
    chosen = rows[("sequence", "forward_backward", 8)]
    assert chosen["strategy"] == "all_to_all" and chosen["collectives"]["all-to-all"] > 0
    assert 0 < chosen["estimated_mib_sent"] < rows[("sequence ring", "forward_backward", 8)]["estimated_mib_sent"]
    timed = {t["sharding"] for t in report["environment"]["timed"]}
    assert timed == {"sequence ring", "sequence all_to_all", "sequence hybrid (2 x N/2)", "heads"}
    text = (tmp_path / "bench_sharded.md").read_text()
    assert "| sequence | forward | 8 |" in text and "| sequence all_to_all | forward_backward | 8 |" in text


@pytest.mark.parametrize("extra", [["--seq-lens", "256,512"], ["--heads", "2"], ["--impl", "jax.dense"]])
def test_sharded_suite_refuses_options_it_cannot_use(tmp_path, extra, capsys):
    assert main(["--suite", "sharded", "--device", "cpu", "--out", str(tmp_path), *extra]) == 2
    assert "--suite sharded" in capsys.readouterr().err


@pytest.mark.parametrize("suite, devices, rule", [
    ("sharded", "3", "power of two"), ("sharded", "1,16", "at most 8"), ("sharded", "0", "positive"),
    ("cpu", "1,8", "only by --suite sharded"), ("quick", "8", "only by --suite sharded")])
def test_devices_is_checked_and_taken_only_by_the_sharded_suite(tmp_path, suite, devices, rule, capsys):
    assert main(["--suite", suite, "--device", "cpu", "--devices", devices, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--devices" in err and rule in err, err
    assert not any(tmp_path.iterdir())  # refused before any work
