"""The float64 oracle and the plain same-dtype baseline, both ``torch_ref.manual_attention`` on CPU.

The oracle runs on the case's inputs converted exactly to float64 (inputs, bias and
cotangent); the baseline runs the same function in the case dtype (fp16 and bf16 matmuls work
on CPU in torch >= 2.11, so ``jax_impl.reference`` with a low-precision ``logits_dtype`` is not
needed). Both return float64 numpy in the JAX layout, like ``Prepared.results()``.

Where torch cannot be imported (the CUDA compile lane's Python 3.12 venv with jax 0.11, for
which no CPU build of torch is at hand), ``$ORACLE_PYTHON`` may name a Python that has it (the
suite's): ``manual_with_grads`` then runs there, in one process kept for the session
(``python -m conformance.oracle`` serves the calls), and the numbers are the same.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from conformance.cases import Inputs

ORACLE_PYTHON = "ORACLE_PYTHON"  # the environment variable


def _run_manual(inputs: Inputs, dtype, **overrides) -> dict[str, np.ndarray]:
    """``dtype`` None: the case dtype (the baseline)."""
    cast = lambda x: None if x is None else np.asarray(x).astype(dtype or inputs.case.np_dtype)
    kw = dict(inputs.attention_kwargs(), mask=inputs.mask)
    if inputs.case.dropout:
        kw["dropout_mask"] = inputs.dropout_keep()
    bias, mod_bias = inputs.bias, None
    if inputs.mods is not None:
        kw, bias, mod_bias = _with_mods(inputs, kw)
    kw.update(overrides)  # an override of None removes the keyword (e.g. scale=None: the default)
    kw = {n: v for n, v in kw.items() if v is not None}
    res = manual_with_grads(cast(inputs.q), cast(inputs.k), cast(inputs.v),
                            cast(inputs.cotangent), bias=cast(bias), **kw)
    if mod_bias is not None and "dbias" in res:  # the total bias's gradient: the case's and the aux's
        d_total = res.pop("dbias")
        if inputs.bias is not None:
            res["dbias"] = _summed_to(d_total, inputs.bias.shape)
        res.update(_mod_aux_gradients(inputs, d_total))
    return res


def _with_mods(inputs: Inputs, kw: dict):
    """The case's mods in the oracle's terms: the mask_mod ANDed into the mask, an additive
    score_mod added to the bias (float64, [B, Hq, Lq, Lk]), a soft cap as the built-in one.
    -> (keywords, bias, the mods' bias or None)."""
    from conformance import mods as mods_mod
    c, m = inputs.case, inputs.mods
    shape = (c.batch, c.q_heads, c.q_len, c.kv_len)
    aux = tuple(np.asarray(x, np.float64) if np.issubdtype(x.dtype, np.floating) else x
                for x in inputs.mod_aux.values())
    kw = dict(kw)
    mod_mask = inputs.mod_mask()
    if mod_mask is not None:
        kw["mask"] = mod_mask if inputs.mask is None else inputs.mask & mod_mask
    if m.oracle_soft_cap is not None:
        kw["logits_soft_cap"] = m.oracle_soft_cap
    mods_mod.check_additive(m, shape, aux, np.random.default_rng(c.seed))
    mod_bias = mods_mod.dense_bias(m, shape, aux)
    if mod_bias is None:
        return kw, inputs.bias, None
    bias = mod_bias if inputs.bias is None else mod_bias + inputs.bias.astype(np.float64)
    return kw, bias, mod_bias


def _summed_to(x: np.ndarray, shape) -> np.ndarray:
    """``x`` summed over the axes that ``shape`` broadcasts (size 1 there)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True)


def _mod_aux_gradients(inputs: Inputs, d_bias: np.ndarray) -> dict[str, np.ndarray]:
    """``{"d<name>": ...}`` for every floating mod_aux entry: the vjp (float64, torch autograd)
    of the dense bias the score_mod makes from it, at the bias's cotangent ``d_bias``."""
    import torch
    from conformance import mods as mods_mod
    c = inputs.case
    aux = {n: torch.from_numpy(np.asarray(x, np.float64)).requires_grad_() if np.issubdtype(x.dtype, np.floating)
           else torch.from_numpy(np.asarray(x)) for n, x in inputs.mod_aux.items()}
    floats = {n: t for n, t in aux.items() if t.requires_grad}
    if not floats:
        return {}
    bias = mods_mod.dense_bias(inputs.mods, (c.batch, c.q_heads, c.q_len, c.kv_len), tuple(aux.values()),
                               xp=torch)
    grads = torch.autograd.grad(bias, tuple(floats.values()),
                                grad_outputs=torch.from_numpy(np.asarray(d_bias, np.float64)))
    return {f"d{n}": g.numpy() for n, g in zip(floats, grads)}


def manual_with_grads(q, k, v, cotangent, **kwargs) -> dict[str, np.ndarray]:
    """``torch_ref.attention_with_grads(manual_attention, ...)`` as float64 numpy: out, dq,
    dk, dv (dbias, dsinks with a bias or sinks), in the inputs' precision. Here, or where torch
    is not importable and ``$ORACLE_PYTHON`` is set, in that Python."""
    try:
        from torch_ref import attention_with_grads, manual_attention
    except ImportError:
        if not os.environ.get(ORACLE_PYTHON):
            raise
        return _Server.get().call(dict(kwargs, q=q, k=k, v=v, cotangent=cotangent))
    res = attention_with_grads(manual_attention, q, k, v, cotangent, **kwargs)
    return {n: np.asarray(x).astype(np.float64) for n, x in res.items()}


class _Server:
    """``python -m conformance.oracle`` in ``$ORACLE_PYTHON``: a call's arrays travel in an
    .npz file (bfloat16 as its bits), the other arguments as a JSON line; it answers ``ok``
    with the results in a second .npz, or ``error ...``."""

    _instance = None

    def __init__(self, python: str):
        root = Path(__file__).resolve().parents[1]
        env = {n: x for n, x in os.environ.items() if n != ORACLE_PYTHON}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
        self.python = python
        self.process = subprocess.Popen([python, "-m", "conformance.oracle"], cwd=root, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        atexit.register(self.process.kill)

    @classmethod
    def get(cls) -> "_Server":
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = cls(os.environ[ORACLE_PYTHON])
        return cls._instance

    def call(self, arguments: dict) -> dict[str, np.ndarray]:
        arrays = {n: x for n, x in arguments.items() if isinstance(x, np.ndarray)}
        bf16 = [n for n, x in arrays.items() if x.dtype == ml_dtypes.bfloat16]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "call.npz")
            np.savez(path, **{n: x.view(np.uint16) if n in bf16 else x for n, x in arrays.items()})
            line = json.dumps({"path": path, "bfloat16": bf16, "kwargs": {
                n: x for n, x in arguments.items() if n not in arrays}},
                default=lambda x: x.item())  # numpy scalars
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline().strip()
            if reply != "ok":
                raise RuntimeError(f"the oracle in {ORACLE_PYTHON}={self.python} failed: "
                                   f"{reply or 'it exited'}")
            with np.load(path + ".out.npz") as results:
                return {n: results[n] for n in results.files}


def _serve() -> None:
    for line in sys.stdin:
        call = json.loads(line)
        try:
            with np.load(call["path"]) as f:
                arrays = {n: f[n].view(ml_dtypes.bfloat16) if n in call["bfloat16"] else f[n]
                          for n in f.files}
            kwargs = {n: tuple(x) if isinstance(x, list) else x for n, x in call["kwargs"].items()}
            results = manual_with_grads(arrays.pop("q"), arrays.pop("k"), arrays.pop("v"),
                                        arrays.pop("cotangent"), **arrays, **kwargs)
            np.savez(call["path"] + ".out.npz", **results)
            print("ok", flush=True)
        except Exception as e:  # noqa: BLE001 (said to the caller, who raises)
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)


def oracle(inputs: Inputs, **overrides) -> dict[str, np.ndarray]:
    """float64 manual attention: out, dq, dk, dv (and dbias, and d<name> per floating mod_aux
    entry). ``overrides`` replace keyword
    arguments (e.g. ``causal_alignment="bottom_right"``, ``scale=1.0``, ``mask=~mask``)."""
    return _run_manual(inputs, np.float64, **overrides)


def baseline(inputs: Inputs) -> dict[str, np.ndarray]:
    """The plain implementation in the case dtype: its error sets the tolerance."""
    return _run_manual(inputs, None)


@dataclasses.dataclass
class References:
    oracle: dict
    baseline: dict


def references(inputs: Inputs) -> References:
    return References(oracle(inputs), baseline(inputs))


if __name__ == "__main__":
    _serve()
