"""tools/tpu_estimate.py runs the kernel as every caller does: its programs of mosaic_tpu
(the call on [B, L, H, D], on [B, H, L, D] data, the kernel alone), traced for a compile-only
v5e chip with no context around them, prefetch no tile list into the forward kernel (libtpu's
static estimate reads prefetched data as 0: a list-walking kernel would be estimated with no
tile visited), and the committed estimate lists exactly the tool's programs."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from tools import tpu_compile_report as report
from tools import tpu_estimate as estimate

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks/results/tpu/estimate.json"


def _forward_prefetches(fn, layout: str) -> list[int]:
    """The scalar-prefetch operand count of each forward kernel that ``fn`` traces."""
    shape = ((estimate.BATCH, estimate.SEQ_LEN, estimate.HEADS, estimate.HEAD_DIM)
             if layout == "blhd" else
             (estimate.BATCH, estimate.HEADS, estimate.SEQ_LEN, estimate.HEAD_DIM))
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                sharding=SingleDeviceSharding(report.chip_device("v5e")))
    jaxpr = jax.make_jaxpr(fn)(spec, spec, spec)
    return [eqn.params["grid_mapping"].num_index_operands for eqn in _equations(jaxpr.jaxpr)
            if eqn.primitive.name == "pallas_call"
            and "forward" in str(eqn.params.get("name", eqn.params.get("name_and_src_info")))]


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ours_prefetch_only_the_lengths_and_the_finite_flag(causal):
    """Each of ours: one forward kernel whose scalar prefetch is q_len and kv_len, plus the
    non-finite flag on the API's calls (no counts, indices or full flags)."""
    programs = [(p, fn, layout) for p, blocks, fn, layout in estimate._programs(causal)
                if p.startswith(estimate.OURS) and blocks == estimate.OURS_BLOCKS[0]]
    assert {p for p, _, _ in programs} == {estimate.OURS, estimate.OURS_HEADS_FIRST,
                                           estimate.OURS_KERNEL}
    for program, fn, layout in programs:
        expected = 2 if program == estimate.OURS_KERNEL else 3  # lengths (+ the finite flag)
        assert _forward_prefetches(fn, layout) == [expected], program


def test_committed_estimate_lists_the_tools_programs():
    """The committed rows are (chip, program, mask, blocks) of the tool's chips, programs and
    block sizes, each once."""
    committed = json.loads(COMMITTED.read_text())
    rows = {(r["chip"], r["program"], r["causal"], r["blocks"]) for r in committed["rows"]}
    assert len(rows) == len(committed["rows"])
    expected = {(chip, program, causal, blocks) for chip in estimate.CHIPS
                for causal in (False, True)
                for program, blocks, _, _ in estimate._programs(causal)}
    assert rows <= expected
    assert {r[1] for r in rows} == set(estimate.PROGRAMS)
