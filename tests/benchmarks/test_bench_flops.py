"""FLOP counts (exact allowed pairs) and the theory table of one score tensor."""
import numpy as np
import pytest

from benchmarks import flops


def _brute_pairs(lq, lk, causal):
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    if causal is None:
        return lq * lk
    offset = lk - lq if causal == "bottom_right" else 0
    return int((j <= i + offset).sum())


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (64, 64), (5, 13), (13, 5), (1, 100), (100, 1), (37, 100),
                                   (100, 37), (129, 128)])
def test_allowed_pairs_are_exact(lq, lk, causal):
    assert flops.allowed_pairs(lq, lk, causal) == _brute_pairs(lq, lk, causal)


def test_allowed_pairs_random_shapes():
    rng = np.random.default_rng(7)
    for lq, lk in rng.integers(1, 300, size=(40, 2)):
        for causal in ("top_left", "bottom_right"):
            assert flops.allowed_pairs(int(lq), int(lk), causal) == _brute_pairs(int(lq), int(lk), causal)


def test_causal_square_is_exact_not_half():
    n = 1024
    assert flops.allowed_pairs(n, n, "top_left") == n * (n + 1) // 2
    assert flops.allowed_pairs(n, n, "top_left") != n * n // 2
    assert flops.allowed_pairs(n, n, "bottom_right") == flops.allowed_pairs(n, n, "top_left")


def test_alignments_differ_when_lengths_differ():
    # 3 queries, 5 keys: top-left allows 1+2+3, bottom-right 3+4+5
    assert flops.allowed_pairs(3, 5, "top_left") == 6
    assert flops.allowed_pairs(3, 5, "bottom_right") == 12
    # 5 queries, 3 keys: top-left 1+2+3+3+3, bottom-right 0+0+1+2+3
    assert flops.allowed_pairs(5, 3, "top_left") == 12
    assert flops.allowed_pairs(5, 3, "bottom_right") == 6


def test_forward_and_backward_flops():
    b, h, lq, lk, d = 2, 3, 40, 56, 64
    fwd = flops.attention_flops(b, h, lq, lk, d)
    assert fwd == 4 * b * h * lq * lk * d
    assert flops.attention_flops(b, h, lq, lk, d, mode="fwd+bwd") == pytest.approx(3.5 * fwd)
    causal = flops.attention_flops(b, h, lq, lk, d, causal="bottom_right")
    assert causal == 4 * b * h * _brute_pairs(lq, lk, "bottom_right") * d
    with pytest.raises(ValueError, match="mode"):
        flops.attention_flops(1, 1, 1, 1, 1, mode="bwd")
    with pytest.raises(ValueError, match="causal"):
        flops.allowed_pairs(2, 2, "diagonal")


def test_case_flops_reads_the_case():
    from conformance.cases import Shape
    case = Shape(1, 8, 300, 64, "float16", kv_len=500).case(causal="bottom_right")
    assert flops.case_flops(case, "fwd") == 4 * 8 * _brute_pairs(300, 500, "bottom_right") * 64


def test_theory_table_matches_the_course():
    rows = {r["L"]: r for r in flops.theory_table(batch=2, heads=8, seq_lens=(1024, 4096))}
    assert rows[1024]["float16"] == 32 * 2 ** 20
    assert rows[1024]["float32"] == 64 * 2 ** 20
    assert rows[4096]["float32"] == 2 ** 30
    assert flops.binary_size(rows[1024]["float16"]) == "32 MiB"
    assert flops.binary_size(rows[1024]["float32"]) == "64 MiB"
    assert flops.binary_size(rows[4096]["float32"]) == "1 GiB"
    assert flops.score_tensor_bytes(1, 8, 2048, 2048, "bfloat16") == 8 * 2048 * 2048 * 2
