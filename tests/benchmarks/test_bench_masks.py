"""python -m benchmarks --suite masks: mask_mod / score_mod / block_mask calls beside torch's
FlexAttention and SDPA, ratios with their spread; and the score_mod calls' compiled programs hold
no score-sized buffer."""
from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from benchmarks import masks
from benchmarks.__main__ import main
from conformance.mods import bound


def _dense(workload):
    aux = tuple(torch.from_numpy(a) for a in workload.aux)
    return masks.dense_mask_or_bias(workload, aux, "cpu", torch.float32).numpy()


def test_dense_masks_and_biases_are_the_workloads():
    """What SDPA gets (and the differences are measured against) is each workload's attention,
    built here pair by pair."""
    length = 64
    by_name = {w.name: w for w in masks.workloads(length, length)}
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    document = np.arange(length) // (length // 8)
    expected = {"packed documents": (document[:, None] == document[None, :]) & (j <= i),
                "prefix-LM": (j <= i) | (j < length // 4),
                "sliding window + global tokens": (j <= i) & ((i - j < length // 8) | (j < 1))}
    for name, allowed in expected.items():
        np.testing.assert_array_equal(_dense(by_name[name]), allowed, err_msg=name)
    slopes = np.array([2.0 ** (-8 * (h + 1) / 8) for h in range(8)])
    alibi = np.where(j <= i, slopes[:, None, None] * (j - i), -np.inf)[None]
    np.testing.assert_allclose(_dense(by_name["ALiBi"]), alibi, rtol=1e-6)
    t5 = by_name["T5 relative bias"]
    table = t5.aux[0]  # rows for the distances kv - q = -8..8, clipped
    bias = np.array([[[table[min(max(c - r, -8), 8) + 8, h] for c in range(length)] for r in range(length)]
                     for h in range(8)])
    np.testing.assert_array_equal(_dense(t5), bias[None])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_masks_suite_writes_every_row_with_ratios_and_differences(tmp_path, monkeypatch):
    """Tiny L; torch's flex_attention eagerly (compiling it would take most of a minute)."""
    monkeypatch.setattr(masks, "compile_flex", False)
    assert main(["--suite", "masks", "--device", "cpu", "--seq-lens", "128", "--repeats", "3",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_masks.json").read_text())
    assert report["flex_compiled"] is False and report["skipped"] == []
    rows = {(r["workload"], r["mode"], r["row"]): r for r in report["rows"]}
    expected = {(w.name, mode, row) for w in masks.workloads(128, 128) for mode in masks.MODES for row in w.rows}
    assert set(rows) == expected
    for (workload, mode, name), row in rows.items():
        if name == masks.FLEX and mode == "fwd+bwd":  # torch has no FlexAttention backward on a CPU
            assert row["status"] == "n.s." and row["median_ms"] is None
            continue
        assert row["status"] == "ok", row
        assert row["median_ms"] > 0 and len(row["times_ms"]) == 3
        if name in (masks.SDPA_DENSE, masks.OURS_PLAIN, masks.SDPA_PLAIN):
            assert row["max_abs_diff_vs_dense"] is None
        else:  # the same attention as SDPA on the dense mask or bias: a dropped mask or bias is off by O(0.1)
            assert row["max_abs_diff_vs_dense"] < 1e-4, row
    ratios = {(r["workload"], r["mode"], r["numerator"], r["denominator"]): r for r in report["ratios"]}
    docs_vs_flex = ratios["packed documents", "fwd", masks.OURS_MASK_MOD, masks.FLEX]
    assert docs_vs_flex["target"] == 1.0
    assert ratios["packed documents", "fwd+bwd", masks.OURS_SEGMENTS, masks.OURS_PLAIN]["target"] == 0.3
    assert ratios["ALiBi", "fwd", masks.OURS_SCORE_MOD, masks.OURS_PLAIN]["target"] == 1.5
    for key, ratio in ratios.items():
        if key[1] == "fwd+bwd" and masks.FLEX in key:
            assert ratio["ratio_median"] is None
            continue
        assert 0 < ratio["ratio_q1"] <= ratio["ratio_median"] <= ratio["ratio_q3"], ratio
        assert ratio["meets_target"] == (None if ratio["target"] is None else ratio["ratio_median"] <= ratio["target"])
    markdown = (tmp_path / "bench_masks.md").read_text()
    assert "| packed documents | 128 | fwd | ours: mask_mod + block_mask / torch flex (compiled) |" in markdown
    assert "torch flex ran EAGERLY" in markdown


def test_masks_suite_takes_repeats_and_time_budget_other_runners_refuse_them(tmp_path, capsys):
    assert main(["--suite", "masks", "--device", "cpu", "--seq-lens", "64", "--repeats", "2",
                 "--time-budget", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_masks.json").read_text())
    assert report["rows"] == [] and len(report["skipped"]) == 2 * len(masks.workloads(64, 64))
    assert main(["--suite", "masks", "--impl", "jax_impl.xla", "--out", str(tmp_path)]) == 2
    assert main(["--suite", "dropout", "--repeats", "2", "--out", str(tmp_path)]) == 2
    assert "(masks) --repeats, --time-budget" in capsys.readouterr().err


# --- structure: no [Lq, Lk] buffer in the score_mod calls' compiled programs ---------------------

LENGTH = 4096


def _buffer_elements(hlo: str) -> list[int]:
    """Element counts of every array shape in an optimised HLO module's text."""
    return [math.prod(int(n) for n in dims.split(",") if n)
            for dims in re.findall(r"\b(?:f|bf|s|u|pred)\d*\[([\d,]*)\]", hlo)]


def _largest_buffer_and_temp_bytes(workload, backward: bool, mods: bool = True, **options) -> tuple[int, int]:
    from jax_impl.flash_attention import flash_attention
    shape = jax.ShapeDtypeStruct((masks.BATCH, LENGTH, masks.HEADS, masks.HEAD_DIM), jnp.float32)
    aux = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in workload.aux)

    def attend(q, k, v, aux):
        score_mod = dict(score_mod=bound(workload.score_mod, jnp), mod_aux=aux) if mods else {}
        return flash_attention(q, k, v, is_causal=workload.causal, **score_mod, **options)

    fn = (jax.grad(lambda q, k, v, aux: jnp.sum(attend(q, k, v, aux) * q), argnums=(0, 1, 2)) if backward
          else attend)
    compiled = jax.jit(fn).lower(shape, shape, shape, aux).compile()
    return max(_buffer_elements(compiled.as_text())), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("name", ["ALiBi", "T5 relative bias"])
def test_score_mod_calls_hold_no_score_sized_buffer(name, backward):
    """At L=4096 the default CPU path's program (xla) holds no buffer of Lq * Lk elements or more,
    and its temporaries exceed the plain xla call's by under a quarter of one float32 [Lq, Lk]."""
    workload = next(w for w in masks.workloads(LENGTH, LENGTH) if w.name == name)
    score_elements = LENGTH * LENGTH
    _, plain_temp = _largest_buffer_and_temp_bytes(workload, backward, mods=False, implementation="xla")
    ours = _largest_buffer_and_temp_bytes(workload, backward)
    # The checks can fail: the dense reference path makes the [B, H, Lq, Lk] scores.
    dense = _largest_buffer_and_temp_bytes(workload, backward, implementation="reference")
    for (largest, temp), holds in ((ours, True), (dense, False)):
        assert (largest < score_elements) == holds, f"largest buffer {largest} elements, Lq * Lk = {score_elements}"
        assert (temp - plain_temp < score_elements) == holds, f"temporaries {temp} bytes, plain xla {plain_temp}"
