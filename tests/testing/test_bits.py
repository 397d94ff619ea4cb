"""ebbtide.testing.bits: bit patterns, not values; messages that say where two tensors differ."""
import pytest

torch = pytest.importorskip("torch")

from ebbtide.testing.bits import (assert_same_bits, bits, bits_equal, describe_mismatch, digests,  # noqa: E402
                                  same_bits)


def test_bits_views_have_the_width_of_the_dtype():
    cases = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64, torch.float8_e4m3fn: torch.uint8, torch.int32: torch.int32,
             torch.bool: torch.bool}
    for dt, want in cases.items():
        t = torch.zeros(3, 2, dtype=dt)
        b = bits(t)
        assert b.dtype == want and b.shape == t.shape, (dt, b.dtype)
    assert bits(torch.tensor([1.0], dtype=torch.bfloat16)).item() == 0x3F80
    assert bits(torch.tensor([-0.0])).item() == -(1 << 31)  # the sign bit alone
    assert bits(torch.zeros(2, dtype=torch.complex64)).shape == (2, 2)


def test_same_bits_tells_what_torch_equal_cannot():
    zero, neg_zero = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(zero, neg_zero) and not same_bits(zero, neg_zero)
    nan = torch.tensor([float("nan")])
    assert not torch.equal(nan, nan) and same_bits(nan, nan.clone())
    other_nan = bits(nan).clone().add_(1).view(torch.float32)  # another payload
    assert not same_bits(nan, other_nan) and bits_equal(nan, other_nan)  # bits_equal: any NaN matches any NaN
    a = torch.randn(5, 7)
    assert same_bits(a, a.clone()) and not same_bits(a, a.to(torch.float64))  # dtype counts
    assert not same_bits(a, a.reshape(7, 5)) and not bits_equal(a, a.reshape(7, 5))  # shape counts
    assert same_bits(a.t(), a.t().contiguous())  # layout does not


def test_bits_equal_needs_nans_at_the_same_places():
    a = torch.tensor([1.0, float("nan"), 3.0])
    b = torch.tensor([1.0, 2.0, 3.0])
    assert not bits_equal(a, b) and not bits_equal(b, a)
    assert bits_equal(a, a.clone())


def test_the_message_counts_and_shows_the_first_differences():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.clone()
    b[1, 2] = 100.0
    b[2, 0] = 8.5
    msg = describe_mismatch(b, a)
    assert msg.startswith("2 of 12 elements differ;") and "(1, 2): 100.0 (0x42c80000) vs 6.0 (0x40c00000)" in msg, msg
    assert describe_mismatch(a, a.double()) == "dtype torch.float32 != torch.float64"
    assert describe_mismatch(a, a.reshape(4, 3)) == "shape (3, 4) != (4, 3)"
    with pytest.raises(AssertionError, match=r"^weights: 2 of 12 elements differ"):
        assert_same_bits(b, a, "weights")
    assert_same_bits(a, a.clone(), "weights")
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):  # NaN payloads count here
        nan = torch.tensor([float("nan")])
        assert_same_bits(nan, bits(nan).clone().add_(1).view(torch.float32))


def test_digests_name_every_tensor_and_see_one_bit():
    a = {"w": torch.ones(4, dtype=torch.bfloat16), "b": torch.zeros(2)}
    d = digests(a)
    assert list(d) == ["w", "b"] and all(len(h) == 64 for h in d.values())
    flipped = dict(a, w=bits(a["w"]).clone().bitwise_xor_(1).view(torch.bfloat16))
    assert digests(flipped)["w"] != d["w"] and digests(flipped)["b"] == d["b"]
    assert digests({"w": a["w"].clone()}) == {"w": d["w"]}
