"""Which collective a sequence-sharded call uses: a small cost model (bytes moved per device).

Strategies (``STRATEGIES``), for a sequence sharded over N devices:

* ``"ring"`` (ring.py): K and V (and, backward, dK and dV in float32, one step behind, then
  home once more) travel N times around the ring, one block per step; N sequential steps whose sends can overlap the step's compute;
  zigzag layout: causal work balanced (max/min 1.0).
* ``"all_to_all"`` (ulysses.py): every operand and result crosses the axis once, (N-1)/N of
  its bytes; 2 collective rounds per pass; each device computes whole sequences for 1/N of
  the heads (balanced whatever the mask). Needs heads divisible by N; a per-head bias or dense
  mask is resharded by head too (its bytes counted: the ring moves none), one shared by every
  head is not taken.
* ``"hybrid"`` (a sequence over two mesh axes (outer, inner), ulysses.py): the all-to-all over
  the inner axis (fast links inside a host), then a ring over the outer one; heads divisible
  by the inner axis size.
* ``"all_gather"``: q, k, v gathered, the attention computed on every device (N times the
  work, memory linear in the whole sequence per device): the fallback.

``choose`` takes the cheapest available strategy by bytes per device (forward + backward),
ring on a tie (its sends overlap compute); all-gather only when neither other runs, or when
asked for. Like MaxText, a user can force the choice (``context_parallel_strategy=``).
"""
from __future__ import annotations

import dataclasses

STRATEGIES = ("ring", "all_to_all", "hybrid", "all_gather")


@dataclasses.dataclass(frozen=True)
class Choice:
    strategy: str
    bytes_per_device: dict  # strategy -> estimated bytes sent per device, fwd + bwd (available ones)
    unavailable: dict       # strategy -> why it cannot run
    requested: bool = False

    def describe(self, n: int, axis) -> str:
        estimates = ", ".join(f"{s} {_mib(b)}" for s, b in self.bytes_per_device.items())
        why = "requested (context_parallel_strategy)" if self.requested else "fewest bytes"
        text = (f"{self.strategy} over {axis!r} ({n} devices; {why}; estimated bytes sent per "
                f"device, forward+backward: {estimates})")
        return text + "".join(f"; {s} unavailable: {r}" for s, r in self.unavailable.items())


def _mib(b: float) -> str:
    return f"{b / 2**20:.3g} MiB"


def estimates(n: int, b: int, lq: int, lk: int, hq: int, hkv: int, d: int, itemsize: int,
              inner: int | None = None, pairwise: float = 0) -> dict:
    """Bytes each device sends, forward + backward, per strategy (local blocks of L/N rows);
    ``inner``: the inner axis size of a two-axis sequence (the hybrid), N = outer * inner;
    ``pairwise``: bytes of the bias and dense mask as the all-to-all moves them (whole arrays,
    each pass that reads them: the bias forward, backward and its gradient back; the ring
    moves none of it)."""
    q_blk = b * lq // n * hq * d * itemsize
    kv_blk = b * lk // n * hkv * d * itemsize
    stats = b * hq * lq // n * 4  # one float32 per (row, head)
    share = (n - 1) / n

    def ring_steps(steps: int) -> float:
        # fwd: K, V per step; bwd: K, V, dK, dV (f32, one step behind) per step, then dK, dV home.
        return steps * 2 * kv_blk + steps * (2 * kv_blk + 2 * kv_blk * 4 // itemsize) + 2 * kv_blk

    ring = ring_steps(n)
    # fwd: q, k, v in; out and (max, log_sum) back. bwd: q, k, v, dO, stats, delta in; dq, dk, dv back.
    resharded = (2 * q_blk + 2 * kv_blk + 2 * stats) + (3 * q_blk + 4 * kv_blk + 3 * stats)
    all_to_all = share * (resharded + pairwise / n)
    # Every device gathers the other N-1 blocks of q, k, v, twice (forward, backward).
    all_gather = (n - 1) * 2 * (q_blk + 2 * kv_blk)
    if inner is None:
        return dict(ring=ring, all_to_all=all_to_all, all_gather=all_gather)
    outer = n // inner
    # The inner all-to-all moves the same blocks over fewer devices; the outer ring's steps
    # carry blocks of L/outer rows for 1/inner of the kv heads: the same bytes per step.
    hybrid = (inner - 1) / inner * resharded + ring_steps(outer)
    return dict(hybrid=hybrid, all_gather=all_gather)


def choose(n: int, shape: tuple, *, ring_unavailable: str | None = None,
           all_to_all_unavailable: str | None = None, requested: str | None = None,
           hybrid_inner: int | None = None, hybrid_unavailable: str | None = None,
           pairwise: float = 0) -> Choice:
    """``shape``: (b, lq, lk, hq, hkv, d, itemsize) of the GLOBAL call. ``*_unavailable``: why
    that strategy cannot run, or None. ``requested``: a strategy the caller insists on (an
    unavailable one raises ValueError naming why)."""
    costs = estimates(n, *shape, inner=hybrid_inner, pairwise=pairwise)
    why_not = ((("hybrid", hybrid_unavailable),) if hybrid_inner else
               (("ring", ring_unavailable), ("all_to_all", all_to_all_unavailable)))
    unavailable = {s: r for s, r in why_not if r}
    if requested is not None and requested not in costs:
        unavailable[requested] = ("it is for a sequence over two mesh axes" if requested == "hybrid"
                                  else "the sequence is sharded over two mesh axes (hybrid or all_gather)")
    available = {s: c for s, c in costs.items() if s not in unavailable}
    if requested is not None:
        if requested in unavailable:
            raise ValueError(f"context_parallel_strategy={requested!r} cannot run this call: "
                             f"{unavailable[requested]}")
        return Choice(requested, available, unavailable, requested=True)
    sharded = {s: c for s, c in available.items() if s != "all_gather"}
    strategy = min(sharded, key=lambda s: (sharded[s], s != "ring")) if sharded else "all_gather"
    return Choice(strategy, available, unavailable)
