"""Lowering the Pallas kernels for CUDA on a host without a GPU: ``jax.export`` (and
``.lower(lowering_platforms=("cuda",))``) of functions that call them, for the tests that read
their Triton IR and for ``tools/compile_report.py``, which compiles it for sm_90a."""
from __future__ import annotations

import contextlib

import jax


# --- Lowering for CUDA on a host without a GPU -----------------------------------------------
# jax >= 0.11's Pallas Triton lowering asks which GPU it targets: with no GPU here an abstract
# mesh names one (an H100: sm_90, as the compile below), and the jitted function's arguments
# are placed on this host's device so that the self-partitioning op (custom_partitioning needs
# concrete devices) still lowers. jax 0.10 reads no target and needs neither.
TARGET_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


def _needs_target() -> bool:
    import importlib.util
    asks = importlib.util.find_spec("jax._src.pallas.triton.gpu_info") is not None  # jax >= 0.11
    return asks and not any(d.platform == "gpu" for d in jax.devices())


def jit_for_cuda(fn):
    """``jax.jit(fn)``, lowerable for CUDA here (inside ``cuda_target()``) on jax 0.10-0.12."""
    if not _needs_target():
        return jax.jit(fn)
    return jax.jit(fn, in_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _target_mesh(axis_name: str):
    device = jax.sharding.AbstractDevice(device_kind=TARGET_DEVICE_KIND, num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)


@contextlib.contextmanager
def cuda_target(axis_name: str = "_"):
    """Around ``jax.export(..., platforms=["cuda"])`` or ``.lower(lowering_platforms=("cuda",))``
    of a ``jit_for_cuda`` function."""
    if not _needs_target():
        yield
        return
    with jax.sharding.use_abstract_mesh(_target_mesh(axis_name)):
        yield


def cuda_mesh(axis_name: str):
    """A one-device mesh for a ``shard_map`` inside a function lowered for CUDA here (with
    ``export_for_cuda(..., axis_name=axis_name)``): this host's device on jax 0.10, the target
    GPU's abstract mesh on jax >= 0.11 (shard_map's mesh must be the one the target names)."""
    if not _needs_target():
        return jax.sharding.Mesh(jax.devices()[:1], (axis_name,))
    return _target_mesh(axis_name)


def export_for_cuda(fn, *args, axis_name: str = "_"):
    """``jax.export`` of ``jit(fn)`` for CUDA, here: the Exported (its ``mlir_module()`` holds
    the kernels' Triton calls). ``axis_name``: that of ``cuda_mesh`` when ``fn`` maps over it."""
    from jax import export
    with cuda_target(axis_name):
        return export.export(jit_for_cuda(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
