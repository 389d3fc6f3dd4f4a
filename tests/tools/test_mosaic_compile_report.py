"""The Mosaic GPU kernels' (forward, dK/dV, dQ) shipped configurations compiled for sm_90a without a GPU
(tools/mosaic_compile_report.py): each compiles, with 0 spill bytes, shared memory within
227 KiB and no more than Config.shared_memory_bytes (plus 4 KiB for the backward's), TMA loads
and stores, wgmma dots, and setmaxnreg giving the consumers 240 registers and the producer 24;
the forward's softmax runs between a partial and a full wgmma wait, unserialised by ptxas.

Needs jax >= 0.11 with its CUDA plugin (Python >= 3.12; CI's jax 0.10 skips it with the reason);
runs the tool in a process of its own (it sets JAX_PLATFORMS=cpu before importing jax): the
shipped configurations in bf16 (the forward's 4 and 4 with dropout, then the backward's; fp16
is the same program with the other 16-bit type, so its rows are read from the committed report,
not compiled again); then, at D=128 only (the larger registers and shared memory; the committed
report, ``--only all``, has their D=64 rows too), the forward and backward with segment ids, with
a bias and a mask together, the fused dQ, and the packed query group's forward: the lane took 4.5 minutes on two workers on the
slower 2-core host (2026-12-02; 11.8 before the shipped rows were compiled once and the rows
with a bias or a mask alone read from the committed report).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_impl import mosaic_gpu

ROOT = Path(__file__).resolve().parents[2]


def _toolchain_missing() -> str | None:
    if mosaic_gpu.unavailable():
        return mosaic_gpu.unavailable()
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is None and \
            importlib.util.find_spec("jax_cuda13_plugin") is None:
        return "the compile report needs jax's CUDA 13 plugin (pip install 'jax[cuda13]')"
    return None


# tests/cuda_compile_lane.sh sets CUDA_COMPILE_LANE=1: there a missing toolchain is a failure, not a skip.
if os.environ.get("CUDA_COMPILE_LANE") == "1" and _toolchain_missing() is not None:
    raise RuntimeError(f"CUDA_COMPILE_LANE=1 but {_toolchain_missing()}")
pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


def _report(tmp_path_factory, *options):
    out = tmp_path_factory.mktemp("report") / "report"
    run = subprocess.run([sys.executable, "-m", "tools.mosaic_compile_report", "--out", str(out),
                          *options], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(Path(str(out) + ".json").read_text())


def _committed_report() -> list[dict]:
    """The rows of benchmarks/results/mosaic_compile_report_sm90.json (``--only all``)."""
    return json.loads((ROOT / "benchmarks/results/mosaic_compile_report_sm90.json").read_text())


def test_the_committed_report_has_every_shipped_row_at_zero_spills():
    """benchmarks/results/mosaic_compile_report_sm90.json (``--only all``): the forward,
    dK/dV and dQ of bf16 and fp16 at D=64/128, causal and not, compiled, 0 spill bytes."""
    committed = _committed_report()
    plain = [r for r in committed if r["label"] == ""]
    for kernel in ("forward", "dK/dV", "dQ"):
        assert {(r["dtype"], r["head_dim"], r["causal"]) for r in plain if r["kernel"] == kernel} == {
            (dt, d, c) for dt in ("bfloat16", "float16") for d in (64, 128) for c in (False, True)}
    for r in plain:
        label = f"{r['kernel']} {r['dtype']} D={r['head_dim']} causal={r['causal']}"
        assert r["ok"] and r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label


def _assert_pairwise_backward_row(r):
    """A backward row with a (constant) bias or a mask: the default backward tiles, 0 spills
    (dK/dV with a float32 bias and a mask at D=128 causal spilled 8/8 bytes until its masked
    tiles took two query bounds per key)."""
    key = (r["kernel"], r["label"], r["head_dim"], r["causal"])
    assert r["ok"], f"{key}: {r['error']}"
    assert (r["block_q"], r["block_kv"], r["num_stages"]) == (64, 64, 2), key
    assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, key


# Dropout beside a bias, a mask or segment ids: the rows that spill, as docs/limitations.md
# names them (bytes stored and loaded at most). dK/dV at D=128: values stored before the
# work-item loop and reloaded outside the tile loops; with every feature at once also a few
# per tile in the band's edge tiles. With segment ids the tile positions are read at an
# address formed in the loop (backward._opaque_warpgroup; a mask causal too), and causal with
# segment ids or a bias alone P^T is dropped after dS^T: segment ids 16 bytes (20 before), 0
# causal (40), a bias causal 4 (16), a mask causal 8 (16).
DROPOUT_STREAMED_SPILLS = {
    ("dK/dV", "bias float32 [1, H] + dropout 0.1", 128, True): 4,
    ("dK/dV", "mask bool [B, 1] + dropout 0.1", 128, False): 12,
    ("dK/dV", "mask bool [B, 1] + dropout 0.1", 128, True): 8,
    ("dK/dV", "segment ids + dropout 0.1", 128, False): 16,
    ("dK/dV", "bias bfloat16 [B, H] + mask + dropout 0.1 + segment ids", 128, True): 76,
}  # every forward row: 0


def test_the_committed_dropout_rows_beside_a_streamed_tile_spill_no_more_than_named():
    """The committed report's rows with dropout beside a bias, a mask or segment ids (bf16,
    D=64/128, causal and not; every feature at once, causal), forward, dK/dV and dQ, all taken
    by the Mosaic kernels: compiled, within 227 KiB and their estimate, spills within
    DROPOUT_STREAMED_SPILLS (else 0). Before, dK/dV spilled 96/96 bytes with a mask and
    128-140 with segment ids at D=128 (and a bias or mask with dropout there took
    pallas_triton's backward)."""
    from tools.mosaic_compile_report import COMBINED_LABEL, DROPOUT_STREAMED
    committed = _committed_report()
    labels = {label for label, _ in DROPOUT_STREAMED}
    found = {(r["kernel"], r["label"], r["head_dim"], r["causal"]): r for r in committed
             if r["label"] in labels | {COMBINED_LABEL}}
    assert set(found) == {(k, label, d, c) for k in ("forward", "dK/dV", "dQ") for label in labels
                          for d in (64, 128) for c in (False, True)} | {
        (k, COMBINED_LABEL, d, True) for k in ("forward", "dK/dV", "dQ") for d in (64, 128)}
    assert set(DROPOUT_STREAMED_SPILLS) <= set(found)
    for key, r in found.items():
        assert r["ok"], f"{key}: {r['error']}"
        most = DROPOUT_STREAMED_SPILLS.get(key, 0)
        assert r["spill_stores"] <= most and r["spill_loads"] <= most, (key, r["spill_stores"])
        slack = 0 if r["kernel"] == "forward" else 4096
        assert r["shared"] <= min(227 * 1024, r["shared_estimate"] + slack), key


def test_the_committed_bias_and_mask_rows_are_the_tiles_shipped_at_zero_spills():
    """The committed report's rows with a bias or a mask (bf16, D=64/128, causal and not): the
    forward compiled on the tiles ``default_config`` chooses for them today (at D=64 128 x 64
    where the ring fits, else 64 x 64) with 0 spill bytes, and the backward's dK/dV and dQ (a
    constant bias) on 64 x 64 x 2 at 0: a change of the choice without a new report fails
    here."""
    from tools.mosaic_compile_report import _pairwise, configurations
    from jax_impl.mosaic_gpu.config import default_config
    committed = _committed_report()
    wanted = {(label, d, causal): options for label, _, d, causal, _, options
              in configurations("bias_mask")}
    for kernel in ("forward", "dK/dV", "dQ"):
        found = {(r["label"], r["head_dim"], r["causal"]): r for r in committed
                 if (r["label"], r["head_dim"], r["causal"]) in wanted and r["kernel"] == kernel}
        assert found.keys() == wanted.keys(), kernel
        for key, r in found.items():
            if kernel != "forward":
                _assert_pairwise_backward_row(r)
                continue
            tiles = default_config(r["head_dim"], r["dtype"],
                                   pairwise_bytes=_pairwise(wanted[key])[2])
            assert (r["block_q"], r["block_kv"], r["num_stages"]) == (
                tiles.block_q, tiles.block_kv, tiles.num_stages), key
            assert r["ok"] and r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, key


def test_every_shipped_configuration_compiles_without_spills_with_the_design_in_the_ptx(
        tmp_path_factory):
    """The shipped configurations' rows, compiled here in bf16 only (fp16 is the same program
    with the other 16-bit type: its rows in the committed report are held by the test above),
    in one test, so that the lane's longest compile (about 4-5 minutes) runs once whatever
    worker takes it; the first compiling test of the lane, which the other worker's tests
    balance."""
    rows = _report(tmp_path_factory, "--dtypes", "bfloat16")
    _assert_within_budget(rows)
    _assert_dropout_rows_shipped(rows)
    _assert_design_in_ptx(rows)


def test_segment_ids_stream_by_tma_and_the_backward_compiles_without_spills(tmp_path_factory):
    """Calls with segment ids (bf16, D=128, causal and not). Every kernel takes one more TMA
    load than without: the streamed tile's ids (key ids in the forward beside Q, K and V; query
    ids in dK/dV beside 7 operands; key ids in dQ beside 8). The dK/dV and dQ kernels: 0 spill
    bytes, shared memory within 227 KiB and their estimate (the ids' ring counted). The
    forward: 0 spill bytes, causal too (Q's wgmma descriptor formed beside each GEMM; hoisted
    out of the loop over work items it spilled 12/12 bytes)."""
    found = _report(tmp_path_factory, "--only", "segments", "--head-dims", "128")
    for kernel, tma_loads in (("forward", 3 + 1), ("dK/dV", 7 + 1), ("dQ", 8 + 1)):
        mine = [r for r in found if r["kernel"] == kernel]
        assert {(r["head_dim"], r["causal"]) for r in mine} == {(128, c) for c in (False, True)}, kernel
        for r in mine:
            label = f"{kernel} D={r['head_dim']} causal={r['causal']} with segment ids"
            assert r["ok"], f"{label}: {r['error']}"
            assert r["tma_loads"] == tma_loads, label
            if kernel == "forward":
                assert r["shared"] <= min(227 * 1024, r["shared_estimate"]), label
                assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
                continue
            assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
            assert r["shared"] <= min(227 * 1024, r["shared_estimate"] + 4096), label
            assert set(r["setmaxnreg"]) == {"inc 240", "dec 24"}, label


@pytest.mark.parametrize("kernels", ["forward", "backward"])  # two processes: the workers share them
def test_a_bias_with_a_mask_compiles_without_spills_forward_and_backward(tmp_path_factory, kernels):
    """A float32 bias [1, H] and a mask, and a bfloat16 bias [B, H] and a mask with dbias (bf16,
    D=128, causal and not: every bias dtype and shape and the mask at once, the most registers
    and shared memory; the rows with a bias or a mask alone are held through the committed
    report, to keep the lane short), on the 64 x 64 x 2 tiles those calls take. The
    forward: 0 spill bytes, shared memory within 227 KiB and its estimate, one more TMA load
    per bias or mask beside Q, K and V, the softmax pipelined and no wgmma serialised. The
    backward: dK/dV and dQ at 0 spills, shared memory within
    227 KiB and its estimate (their rings counted), one more TMA load per bias or mask beside
    the 7 (dK/dV) or 8 (dQ) streamed and resident operands, and with dbias dQ's TMA stores of
    dS."""
    from tools.mosaic_compile_report import DBIAS_LABEL
    found = _report(tmp_path_factory, "--only", "bias_with_mask", "--head-dims", "128", "--kernels", kernels)
    labels = ("bias float32 [1, H] + mask", DBIAS_LABEL)
    assert sorted((r["kernel"], r["label"], r["causal"]) for r in found) == sorted(
        (kernel, label, c) for kernel in {"forward": ("forward",), "backward": ("dK/dV", "dQ")}[kernels]
        for label in labels for c in (False, True))
    for r in found:
        label = f"{r['kernel']} {r['label']} D={r['head_dim']} causal={r['causal']}"
        assert r["ok"], f"{label}: {r['error']}"
        pairwise = ("bias" in r["label"]) + ("mask" in r["label"])
        if r["kernel"] != "forward":
            _assert_pairwise_backward_row(r)
            assert r["shared"] <= min(227 * 1024, r["shared_estimate"] + 4096), label
            assert r["tma_loads"] == {"dK/dV": 7, "dQ": 8}[r["kernel"]] + pairwise, label
            assert set(r["setmaxnreg"]) == {"inc 240", "dec 24"}, label
            # dQ stores dQ once per item and, with dbias, dS in each loop body that attends
            dbias = r["kernel"] == "dQ" and r["label"] == DBIAS_LABEL
            assert r["tma_stores"] == {"dK/dV": 2, "dQ": 1}[r["kernel"]] + dbias * (
                2 if r["causal"] else 1), label
            continue
        assert (r["block_q"], r["block_kv"], r["num_stages"]) == (64, 64, 2), label
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
        assert r["shared"] <= min(227 * 1024, r["shared_estimate"]), label
        assert r["tma_loads"] == 3 + pairwise, label
        assert r["partial_waits"] >= 1 and r["serialized"] == [], label


def test_the_fused_dq_backward_compiles_without_spills(tmp_path_factory):
    """BackwardConfig(dq="fused") at the default tiles (bf16, D=128, causal and not; causal
    also with segment ids, dropout, and GQA with lengths, window and soft cap): one kernel
    (dK/dV, no dQ kernel) with 0 spill bytes, shared memory within 227 KiB and its estimate
    (dS^T and the fp32 dQ tile counted), and dQ's TMA reduce-add in the PTX."""
    from tools.mosaic_compile_report import FUSED_DQ_LABEL, FUSED_DQ_MASKS
    found = _report(tmp_path_factory, "--only", "fused_dq", "--kernels", "backward", "--head-dims", "128")
    assert sorted((r["kernel"], r["label"], r["head_dim"], r["causal"]) for r in found) == sorted(
        [("dK/dV", FUSED_DQ_LABEL, 128, c) for c in (False, True)]
        + [("dK/dV", f"{FUSED_DQ_LABEL}, {m}", 128, True) for m, _ in FUSED_DQ_MASKS])
    for r in found:
        label = f"{r['label']} D={r['head_dim']} causal={r['causal']}"
        assert r["ok"], f"{label}: {r['error']}"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
        assert r["shared"] <= min(227 * 1024, r["shared_estimate"] + 4096), label
        # one reduce-add per loop body that attends (the causal edge tiles have their own)
        assert r["tma_reduces"] >= (2 if r["causal"] else 1), label
        assert r["tma_loads"] >= 7 and set(r["setmaxnreg"]) == {"inc 240", "dec 24"}, label


def _assert_packed_rows(rows, head_dims):
    """The packed query group's forward rows (bf16, causal and not, and with segment ids at
    D=128 causal): packed as the shipped rule decides, 0 spill bytes, shared memory within its estimate, the softmax pipelined and no
    wgmma serialised."""
    from tools.mosaic_compile_report import PACKED_LABEL
    assert sorted((r["label"], r["head_dim"], r["causal"]) for r in rows) == sorted(
        [(PACKED_LABEL, d, c) for d in head_dims for c in (False, True)]
        + [(f"{PACKED_LABEL}, segment ids", 128, True)] * (128 in head_dims))
    for r in rows:
        label = f"{r['label']} D={r['head_dim']} causal={r['causal']}"
        assert r["ok"] and r["packed"] and r["kernel"] == "forward", f"{label}: {r['error']}"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
        assert r["shared"] <= min(227 * 1024, r["shared_estimate"]), label
        assert r["tma_loads"] >= 3 and r["partial_waits"] >= 1 and r["serialized"] == [], label


def test_a_packed_query_group_compiles_without_spills(tmp_path_factory):
    """The forward with each kv head's 8 query heads packed into its rows (Lq=96, MQA: the
    band and lengths per row's query position, the sinks per row's head), at D=128, causal
    and not, and with segment ids; the committed report holds the D=64 rows (next test)."""
    _assert_packed_rows(_report(tmp_path_factory, "--only", "packed", "--head-dims", "128"),
                        (128,))


def test_the_committed_packed_rows_are_packed_at_zero_spills():
    """benchmarks/results/mosaic_compile_report_sm90.json's packed rows, D=64 and 128."""
    from tools.mosaic_compile_report import PACKED_LABEL
    _assert_packed_rows([r for r in _committed_report() if r["label"].startswith(PACKED_LABEL)],
                        (64, 128))


def test_the_committed_mods_rows_walk_tile_lists_at_the_plain_calls_cost():
    """benchmarks/results/mosaic_compile_report_sm90.json's rows with a score_mod (ALiBi, its
    slopes in mod_aux), a mask_mod and its block_mask (``--only mods``: bf16, D=64/128, causal
    and not, forward and backward): compiled, the shared memory of the plain call of the same
    head_dim (the tile lists are scalars read from global memory), 0 spill bytes. Read from the
    committed report, not compiled here: the lane's budget."""
    from tools.mosaic_compile_report import MODS_LABEL
    committed = _committed_report()
    mods = [r for r in committed if r["label"] == MODS_LABEL]
    assert {(r["kernel"], r["head_dim"], r["causal"]) for r in mods} == {
        (kernel, d, c) for kernel in ("forward", "dK/dV", "dQ") for d in (64, 128)
        for c in (False, True)}
    plain = {(r["kernel"], r["head_dim"], r["causal"]): r["shared"] for r in committed
             if r["label"] == "" and r["dtype"] == "bfloat16"}
    for r in mods:
        key = (r["kernel"], r["head_dim"], r["causal"])
        assert r["ok"] and r["shared"] == plain[key], key
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, key


def test_one_side_padded_alone_compiles_without_spills(tmp_path_factory):
    """The forward, not causal, with only its keys padded (Lq=4096, Lk=4000: the mask is the
    key lengths alone, which no row reads) at D=64/128/256, or only its queries (Lq=4000) at
    D=64/128: compiled, 0 spill bytes. Keys padded alone failed Mosaic's layout inference at
    D=128 until 2026-12-02 (the row iota was built and left unused), as did the candidate
    Config(64, 192, 2) at D=64 (4096 keys are no whole number of 192-key tiles)."""
    found = _report(tmp_path_factory, "--only", "edges")
    assert sorted((r["label"].split(":")[0], r["head_dim"]) for r in found) == sorted(
        [("keys padded alone", d) for d in (64, 128, 256)]
        + [("queries padded alone", d) for d in (64, 128)])
    for r in found:
        label = f"{r['label']} D={r['head_dim']}"
        assert r["ok"], f"{label}: {r['error']}"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label


def test_head_dim_256_forward_compiles_within_its_named_spills(tmp_path_factory):
    """The forward at head_dim 256 on config.D256's tiles (bf16, causal and not: plain, with
    lengths, bottom-right, window, soft cap and sinks, with segment ids): compiled, within
    227 KiB and its estimate, TMA and wgmma in the PTX, no partial wgmma wait (each tile's
    P V waited before the next S: ``Config.overlap=False``), and 0 spill bytes (4-12 causal with
    Q's wgmma descriptor hoisted out of the loop over work items, 16-24 with the overlap)."""
    found = _report(tmp_path_factory, "--only", "d256")
    assert {(r["label"], r["causal"]) for r in found} == {
        (label, c) for label in ("D=256", "D=256, lengths, bottom-right, window, soft cap, sinks",
                                 "D=256, segment ids") for c in (False, True)}
    for r in found:
        label = f"{r['label']} causal={r['causal']}"
        assert r["ok"] and r["kernel"] == "forward" and r["head_dim"] == 256, f"{label}: {r['error']}"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
        assert r["shared"] <= min(227 * 1024, r["shared_estimate"]), label
        assert (r["block_q"], r["block_kv"], r["num_stages"]) == (64, 64, 2), label
        assert r["tma_loads"] >= 3 and r["wgmma"] > 0 and r["partial_waits"] == 0, label
        assert set(r["setmaxnreg"]) == {"inc 240", "dec 24"} and r["serialized"] == [], label


def _assert_within_budget(rows):
    for kernel in ("forward", "dK/dV", "dQ"):
        assert {(r["dtype"], r["head_dim"], r["causal"]) for r in rows if r["kernel"] == kernel} == {
            ("bfloat16", d, c) for d in (64, 128) for c in (False, True)}
    for r in rows:
        label = f"{r['kernel']} {r['dtype']} D={r['head_dim']} causal={r['causal']}"
        assert r["ok"], f"{label}: {r['error']}"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, label
        assert r["shared"] <= 227 * 1024, label
        # the forward's estimate counts Mosaic's alignment: an upper bound
        assert r["shared"] <= r["shared_estimate"] + (0 if r["kernel"] == "forward" else 4096), label


def _assert_dropout_rows_shipped(rows):
    """The forward, dK/dV and dQ with dropout (the hash on each tile; the forward's default
    tiles at D=128 are then 64 x 64) at D=64/128, causal and not: held to 0 spills by
    ``_assert_within_budget``."""
    from tools.mosaic_compile_report import DROPOUT_LABEL
    found = {(r["kernel"], r["head_dim"], r["causal"]): r for r in rows
             if r["label"] == DROPOUT_LABEL}
    assert set(found) == {(k, d, c) for k in ("forward", "dK/dV", "dQ") for d in (64, 128)
                          for c in (False, True)}
    assert {(r["block_q"], r["block_kv"]) for (k, d, _), r in found.items()
            if k == "forward" and d == 128} == {(64, 64)}


def _assert_design_in_ptx(rows):
    """TMA loads (Q, K, V) and stores (O, statistics), wgmma dots, mbarrier waits, and the
    register rebalancing between the warpgroup roles."""
    for r in rows:
        label = f"{r['kernel']} {r['dtype']} D={r['head_dim']} causal={r['causal']}"
        # forward: Q, K, V in, O and two statistics out; dK/dV: K, V, Q, dO and three row
        # vectors in, dK and dV out; dQ: Q, dO, three row vectors, K, V, the keys' poison in
        assert r["tma_loads"] >= 3 and r["tma_stores"] >= {"forward": 3, "dK/dV": 2, "dQ": 1}[
            r["kernel"]], label
        assert r["wgmma"] > 0 and r["mbarrier_waits"] > 0, label
        assert set(r["setmaxnreg"]) == {"inc 240", "dec 24"}, label  # FA3's split, every kernel
        if r["kernel"] == "forward":
            # FA3's intra-warpgroup pipelining: the next S = Q K^T and this P V in flight
            # together, the softmax between their waits (wait_group 1, then 0), and ptxas did
            # not serialise the wgmmas (C7513 when registers a running wgmma reads are
            # written, C7512 when registers run short)
            assert r["partial_waits"] >= 1, label
            assert r["serialized"] == [], label
        if r["kernel"] != "forward":  # dK/dV: S^T, dP^T, dV, dK per tile; dQ: S, dP, dQ
            assert r["wgmma"] >= (4 if r["kernel"] == "dK/dV" else 3), label


@pytest.mark.parametrize("option, value", [("--dtypes", "float32"), ("--head-dims", "128,wide")])
def test_row_filters_refuse_what_they_cannot_select(option, value, capsys):
    from tools.mosaic_compile_report import main
    with pytest.raises(SystemExit) as exit_:
        main([option, value])
    assert exit_.value.code == 2 and option in capsys.readouterr().err
