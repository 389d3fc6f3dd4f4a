"""examples/train_tiny_lm.py, a handful of steps: the jitted train step compiles once, and
flash_attention and Flax's default attention give the same losses step by step."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_lm.py"


@pytest.fixture(scope="module")
def lm():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(lm):
    cfg = dataclasses.replace(lm.Config(), seq_len=64, batch_size=4, d_model=32, num_layers=1, seed=3)
    documents = lm.load_documents()
    vocab = lm.build_vocab(documents)
    batches = lm.pack_batches(lm.encode(documents, vocab), cfg, steps=6)
    return cfg, vocab, batches, lm.init_params(cfg, len(vocab))


def test_packed_batches_have_several_documents_per_row(lm, setup):
    cfg, vocab, batches, _ = setup
    seg = batches["segment_ids"]
    assert seg.shape == (6, cfg.batch_size, cfg.seq_len)
    assert np.all(seg.max(axis=-1) >= 2)  # every row packs >= 2 documents
    assert np.all(np.diff(seg, axis=-1)[seg[..., 1:] > 0] >= 0)  # ids never go back
    # A target is counted only within its document: never across a boundary or on padding.
    starts = batches["targets"] == lm.BOS
    assert not np.any(batches["weights"][starts])
    assert batches["weights"].sum() > 0.8 * batches["weights"].size


def test_flash_and_default_agree_step_by_step_and_compile_once(lm, setup):
    cfg, vocab, batches, params = setup
    runs = {name: lm.train(cfg, len(vocab), params, batches, name, progress=False)
            for name in ("flash", "default")}
    flash, default = runs["flash"]["losses"], runs["default"]["losses"]
    for run in runs.values():
        assert run["traces"] == 1, run["traces"]          # traced (and compiled) once for 6 steps
        if run["jit_cache_size"] is not None:               # where this jax exposes it
            assert run["jit_cache_size"] == 1
    # Same init, same batches, float32: a different masking path (segment ids + is_causal vs
    # a dense mask) and a blocked softmax round differently, by ~1e-7 per step.
    np.testing.assert_allclose(flash, default, rtol=1e-5, atol=0)
    assert flash[-1] < flash[0] - 0.3, flash            # and it does learn
    ok, problems = lm.compare_curves(flash, default)
    assert ok, problems
    # The comparison can fail: a shifted curve is caught.
    assert not lm.compare_curves(flash, [x * (1 + 1e-3) for x in default])[0]


def test_flash_model_respects_document_boundaries(lm, setup):
    """Changing one document changes no logit of another document packed in the same row."""
    cfg, vocab, batches, params = setup
    model = lm.TinyLM(cfg, len(vocab), attention="flash")
    tokens, seg = batches["inputs"][0], batches["segment_ids"][0]
    row = int(np.argmax(seg.max(-1) >= 2))
    first = seg[row] == 1
    changed = tokens.copy()
    changed[row, first] = (tokens[row, first] + 1 - 2) % (len(vocab) - 2) + 2  # other characters
    apply = jax.jit(model.apply)
    before = apply({"params": params}, jnp.asarray(tokens), jnp.asarray(seg))
    after = apply({"params": params}, jnp.asarray(changed), jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(before)[row, ~first], np.asarray(after)[row, ~first])
    assert not np.allclose(np.asarray(before)[row, first], np.asarray(after)[row, first])
