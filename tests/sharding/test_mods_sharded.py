"""score_mod / mask_mod / block_mask calls on sharded inputs (scripts/mods_sharded.py)."""
import pytest
from _spawn import run_script


@pytest.fixture(scope="module")
def report():
    return run_script("mods_sharded.py")


def test_mods_on_sharded_inputs_give_the_one_device_answer(report):
    s = report
    assert s["batch"] < 1e-5 and s["sequence"] < 1e-5
    assert s["sequence_explain"].startswith("one program: ") and "global indices" in s["sequence_explain"]
    assert s["ring"].startswith("context_parallel_strategy='ring' cannot run a call with score_mod")
    # Inside shard_map the strategies give the mods global indices: out, dq and d(slopes).
    assert max(s[f] for f in ("ring_attention", "ulysses_attention", "hybrid_attention")) < 1e-5
    # The C++ kernel as the local step, by name and automatically: its programs run the mods
    # as the strategies wrap them (global indices).
    for strategy in ("ring_attention", "ulysses_attention"):
        for implementation in ("None", "cpu"):
            assert s[f"alibi_{strategy}_{implementation}"] < 1e-5, (strategy, implementation, s)


def test_mods_on_a_mesh_with_explicit_axes_run_as_one_program_with_the_shardings_kept(report):
    """Explicit axes (the sharding in the types, with and without set_mesh): the one-device
    answer and gradients, out and dq sharded like q; an interpreter whose callbacks cannot
    run replicated is refused by name."""
    s = report
    for name in ("explicit_batch", "explicit_sequence"):
        assert s[name] < 1e-5, (name, s[name])
        assert s[name + "_shardings"] == [s[name + "_want"]] * 2, s
    assert s["explicit_interpreter"].startswith("interpret=True: mosaic_tpu's interpreter cannot run")
