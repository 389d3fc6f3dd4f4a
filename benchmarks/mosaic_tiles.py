"""The Mosaic GPU forward's tile candidates, the backward's dQ strategies and the forward's
query-group packing, as benchmark plug-ins (``--impl module:function``).

    python -m benchmarks --suite mosaic_tiles --device cuda     # run_gpu.sh's step 3b
    python -m benchmarks --suite mosaic_dq --device cuda        # run_gpu.sh's step 3c
    python -m benchmarks --suite mosaic_pack --device cuda      # run_gpu.sh's step 3d

``TILE_CANDIDATES`` is the sweep of ``tools.mosaic_compile_report --only candidates``
(query rows per consumer warpgroup, keys per stage, stages); each candidate is a function
``q{block_q}_kv{block_kv}_s{stages}`` with flash_attention's signature that runs
``implementation="mosaic_gpu"`` with those tiles. A candidate whose K/V ring does not fit the
shared memory at a case's head_dim says so (``unsupported``) instead of failing at launch.
"""
from __future__ import annotations

import numpy as np

# (block_q, block_kv, num_stages); the first is the default before the sweep
# (mosaic_gpu.config.PREVIOUS_DEFAULT).
TILE_CANDIDATES = ((64, 128, 2), (64, 128, 3), (64, 192, 2), (64, 64, 3), (64, 256, 2),
                   (128, 64, 2), (128, 64, 3), (128, 128, 2))


def name(block_q: int, block_kv: int, num_stages: int) -> str:
    return f"q{block_q}_kv{block_kv}_s{num_stages}"


def _candidate(block_q: int, block_kv: int, num_stages: int):
    def attend(q, k, v, bias=None, mask=None, **keywords):
        from jax_impl.flash_attention import flash_attention
        from jax_impl.mosaic_gpu.config import Config
        return flash_attention(q, k, v, bias, mask, implementation="mosaic_gpu",
                               block_sizes=Config(block_q, block_kv, num_stages), **keywords)

    def unsupported(case) -> str | None:
        from jax_impl.mosaic_gpu.config import SHARED_MEMORY_BUDGET, Config
        need = Config(block_q, block_kv, num_stages).shared_memory_bytes(
            case.head_dim, np.dtype("float16"))
        if need > SHARED_MEMORY_BUDGET:
            return (f"tiles {name(block_q, block_kv, num_stages)} need {need / 1024:.1f} KiB of "
                    f"shared memory at head_dim={case.head_dim} (> {SHARED_MEMORY_BUDGET // 1024})")
        return None

    attend.unsupported = unsupported
    attend.__name__ = name(block_q, block_kv, num_stages)
    return attend


for _tiles in TILE_CANDIDATES:
    globals()[name(*_tiles)] = _candidate(*_tiles)

PLUGINS = tuple(f"benchmarks.mosaic_tiles:{name(*t)}" for t in TILE_CANDIDATES)


# The backward's dQ strategies (``BackwardConfig.dq``), each a function ``backward_dq_{dq}``
# that runs the default forward tiles with the Mosaic GPU backward's default tiles and that dQ.
DQ_STRATEGIES = ("separate", "fused")


def _dq_strategy(dq: str):
    def attend(q, k, v, bias=None, mask=None, **keywords):
        import dataclasses

        from jax_impl.flash_attention import flash_attention
        from jax_impl.mosaic_gpu.config import default_backward_config, default_config
        head_dim, dtype = q.shape[-1], q.dtype
        backward = dataclasses.replace(default_backward_config(head_dim, dtype), dq=dq)
        tiles = dataclasses.replace(
            default_config(head_dim, dtype, dropout=bool(keywords.get("dropout_rate"))),
            backward="mosaic_gpu", backward_config=backward)
        return flash_attention(q, k, v, bias, mask, implementation="mosaic_gpu",
                               block_sizes=tiles, **keywords)

    attend.__name__ = f"backward_dq_{dq}"
    return attend


for _dq in DQ_STRATEGIES:
    globals()[f"backward_dq_{_dq}"] = _dq_strategy(_dq)

DQ_PLUGINS = tuple(f"benchmarks.mosaic_tiles:backward_dq_{dq}" for dq in DQ_STRATEGIES)


def unpacked(q, k, v, bias=None, mask=None, **keywords):
    """The default tiles with the query group never packed (``Config(pack_query_group=False)``):
    what the default (``jax_impl.mosaic_gpu``, packed where ``packs_query_group`` says it pays)
    is timed against."""
    import dataclasses

    from jax_impl.flash_attention import flash_attention
    from jax_impl.mosaic_gpu.config import default_config
    tiles = dataclasses.replace(default_config(q.shape[-1], q.dtype), pack_query_group=False)
    return flash_attention(q, k, v, bias, mask, implementation="mosaic_gpu", block_sizes=tiles,
                           **keywords)


PACK_PLUGINS = ("benchmarks.mosaic_tiles:unpacked",)
