"""Static configuration: frozen, hashable, passed to jit/custom_vjp as static arguments."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jax import lax

from jax_impl.masking import MaskSpec


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the Pallas kernels (powers of two, at least 16: Triton's dot minimum).

    The forward kernel tiles queries by ``block_q`` and keys by ``block_k``; the dK/dV
    kernel keeps a ``block_k_dkv`` key tile and walks query tiles of ``block_q_dkv``; the
    dQ kernel keeps a ``block_q_dq`` query tile and walks key tiles of ``block_k_dq``.
    The xla implementation uses ``block_q`` and ``block_k`` as its chunk sizes.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 32
    num_warps: int = 4
    num_warps_bwd: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"BlockSizes.{field.name}={value!r} must be an int")
            if field.name.startswith("block_") and (value < 16 or not _is_power_of_two(value)):
                raise ValueError(
                    f"BlockSizes.{field.name}={value} must be a power of two >= 16 "
                    "(Triton tiles are powers of two and its dot needs 16)")
            if field.name.startswith("num_warps") and value not in (1, 2, 4, 8, 16):
                raise ValueError(f"BlockSizes.{field.name}={value} must be one of 1, 2, 4, 8, 16")
            if field.name == "num_stages" and not 1 <= value <= 8:
                raise ValueError(f"BlockSizes.num_stages={value} must be in [1, 8]")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one attention call, after validation."""

    scale: float
    mask: MaskSpec
    logits_soft_cap: float | None = None
    block_sizes: BlockSizes | None = None  # None: the implementation's heuristic
    interpret: bool = False
    precision: lax.Precision = lax.Precision.HIGHEST  # of fp32 matmuls: no silent TF32
    debug: bool = False  # Pallas prints each kernel's jaxpr and Triton IR when lowering
    # Attention dropout on P (dropout_sinks.py); the seeds are a traced input (SinksAndDropout.dropout_seeds).
    dropout_rate: float = 0.0
    bias_gradient: bool = True  # False: the bias is a constant; backward computes no dbias
    # The forward runs the implementation's decode path (few query rows, long cache; chosen
    # by implementations.decode_path); the backward is always the regular one.
    decode: bool = False
    # A sequence-sharded call's collective (cp_cost.STRATEGIES), None: the cost model picks.
    context_parallel_strategy: str | None = None
    # FlexAttention's score and mask functions (mods.py); hashed by identity, like jit's
    # static arguments: pass the same function object to reuse a compilation.
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    # Per mod_aux entry, whether it is differentiated (the custom VJP's symbolic zeros set it);
    # None: every floating entry is (mods.gradient_entries).
    aux_gradients: tuple[bool, ...] | None = None

    @property
    def has_mods(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None
