"""The block-scaled low-precision formats of DeepSeek's released weights (SPEC §6), as plain torch formulas.

A quantised matrix is ``codes * scale`` blockwise: ``codes`` on a small float grid (FP8 e4m3, max 448; FP4 e2m1,
values ±{0, .5, 1, 1.5, 2, 3, 4, 6}, two per byte, the low nibble the even column), ``scale`` one e8m0 byte per
block, ``2^(byte - 127)`` (255 is NaN). Blocks are ``BLOCK_FP8`` = 32 x 32 for the FP8 matrices (scale
``[⌈out/32⌉, ⌈in/32⌉]``), and 1 x 32 (one scale per 32 columns of a row) for FP4 experts and the FP8 Engram
tables.

The scale of a block is the smallest power of two at which no value rounds past the grid's largest code:
``s = 2^⌈log2(amax / (qmax + gap/2))⌉``, ``gap`` the grid's spacing below ``qmax`` (464 for e4m3, 7 for e2m1). The
reference quantises activations with ``2^⌈log2(amax / qmax)⌉`` instead; that rule is not idempotent: a block whose
amax sits just above ``qmax/2`` rounds down to ``qmax/2`` and requantises at half the scale (other bytes, same
values). With ``qmax + gap/2`` the largest code of a block is always above the next smaller scale's limit, so
dequantise -> quantise returns the same scale and codes. A block that another rule wrote (largest code <= qmax/2,
an all-zero block) has the same values under several scales; ``quantize(..., keep=scale)`` keeps a given scale
wherever it still represents the block exactly, which is how an export writes untrained tensors byte for byte.
"""
import functools

import torch

E4M3_MAX, E4M3_LIMIT = 448.0, 464.0  # the largest code; the largest amax/scale that rounds to it
E2M1_MAX, E2M1_LIMIT = 6.0, 7.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
# Midpoints between neighbouring codes, and whether a tie there goes up (to the even code).
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E8M0_BIAS, E8M0_MIN, E8M0_MAX = 127, -127, 127  # exponents of the finite scales (byte 0..254)
BLOCK_FP8, BLOCK_ROW = (32, 32), (1, 32)
FORMATS = ("fp8", "fp4")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (``float8_e8m0fnu`` or uint8) -> fp32 ``2^(byte - 127)``; byte 255 -> NaN."""
    byte = scale.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte - E8M0_BIAS)
    return torch.where(byte == 255, torch.nan, value)


def exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents (in ``E8M0_MIN..E8M0_MAX``) -> ``float8_e8m0fnu`` bytes."""
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def e2m1_to_float(nibbles: torch.Tensor) -> torch.Tensor:
    """FP4 codes 0..15 (int) -> fp32: sign bit 3, magnitude ``E2M1_VALUES[code & 7]``."""
    table = torch.tensor(E2M1_VALUES, device=nibbles.device)
    magnitude = table[(nibbles & 7).long()]
    return torch.where((nibbles & 8) != 0, -magnitude, magnitude)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> FP4 codes 0..15 (uint8): the nearest grid value, ties to the
    even code (round-to-nearest-even, as the hardware converts), past 6 clamped, the sign kept also for zero. The
    code is the number of midpoints below |x|; a tie counts when the code above it is the even one."""
    a = x.abs()
    code = sum(((a >= m) if up else (a > m)).to(torch.uint8) for m, up in E2M1_MIDPOINTS)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[out, in]`` -> ``[⌈out/r⌉, ⌈in/c⌉, r, c]`` (zero padded), the blocks of ``block = (r, c)``."""
    (rows, cols), (r, c) = x.shape, block
    padded = torch.nn.functional.pad(x, (0, -cols % c, 0, -rows % r))
    return padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c).transpose(1, 2)


def _unblocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n_r, n_c, r, c = blocks.shape
    return blocks.transpose(1, 2).reshape(n_r * r, n_c * c)[:shape[0], :shape[1]]


def _blockwise(x: torch.Tensor, factor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` times one ``factor`` per block: one broadcast product over a view when the blocks tile ``x`` (the
    released matrices), else over the zero-padded blocks."""
    (rows, cols), (r, c) = x.shape, block
    if rows % r or cols % c:
        return _unblocks(_blocks(x, block) * factor[:, :, None, None], x.shape)
    return (x.reshape(rows // r, r, cols // c, c) * factor[:, None, :, None]).view(rows, cols)


def choose_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The smallest e such that ``amax / 2^e <= limit`` (so every value rounds to at most the largest code),
    clamped to e8m0's range; an all-zero block takes the smallest scale."""
    mantissa, exponent = torch.frexp(amax.double() / limit)  # x = m * 2^e, 0.5 <= m < 1: 2^e >= x > 2^(e-1)
    exponent = exponent - (mantissa == 0.5).int()  # an exact power of two is its own ceiling
    return torch.where(amax > 0, exponent, E8M0_MIN).clamp(E8M0_MIN, E8M0_MAX)


def quantize(w: torch.Tensor, fmt: str, block: tuple[int, int], keep: torch.Tensor | None = None):
    """``w [out, in]`` -> ``(codes, scale)``: fp8 codes ``float8_e4m3fn [out, in]`` or fp4 codes packed
    ``uint8 [out, in/2]``; ``scale`` ``float8_e8m0fnu [⌈out/r⌉, ⌈in/c⌉]`` for ``block = (r, c)``. ``keep``: a
    scale of that shape to reuse for every block it represents exactly (its values are codes times it)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantize: format {fmt!r}, use one of {FORMATS}")
    if fmt == "fp4" and (w.shape[1] % 2 or block[0] != 1):
        raise ValueError(f"fp4 packs two columns per byte in row blocks: shape {tuple(w.shape)}, block {block}")
    x = w.float()
    limit = E4M3_LIMIT if fmt == "fp8" else E2M1_LIMIT
    exponent = choose_exponent(_blocks(x, block).abs().amax((-1, -2)), limit)
    if keep is not None:
        exact = _represents(x, fmt, block, e8m0_to_float(keep))
        exponent = torch.where(exact, keep.view(torch.uint8).to(torch.int32) - E8M0_BIAS, exponent)
    codes = _codes(_blockwise(x, torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), -exponent), block), fmt)
    return codes, exponent_to_e8m0(exponent)


def _codes(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Values already divided by their scale -> the format's codes (fp8 ``float8_e4m3fn``; fp4 packed uint8)."""
    if fmt == "fp8":
        return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    nibbles = round_e2m1(scaled)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _represents(x: torch.Tensor, fmt: str, block: tuple[int, int], scale: torch.Tensor) -> torch.Tensor:
    """Per block: whether ``x`` is exactly codes times ``scale`` (a finite scale, every value on the grid)."""
    finite = scale.isfinite()
    scale = torch.where(finite, scale, 1.0)
    same = _blockwise(_code_values(_codes(_blockwise(x, 1 / scale, block), fmt), fmt), scale, block) == x
    return (_blocks((~same).float(), block).amax((-1, -2)) == 0) & finite  # padding counts as matching


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: str, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` blockwise, in ``dtype`` (exact in bf16 and fp32: a code times a power of two). fp4 codes
    are packed ``[out, in/2]`` bytes (uint8, int8 or ``float4_e2m1fn_x2``), the low nibble the even column."""
    if fmt not in FORMATS:
        raise ValueError(f"dequantize: format {fmt!r}, use one of {FORMATS}")
    return _blockwise(_code_values(codes, fmt), e8m0_to_float(scale), block).to(dtype)


def _code_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The grid values of fp8 codes, or of packed fp4 bytes (``[out, in/2]`` -> ``[out, in]``), in fp32: each byte
    looks up its two values at once as an embedding row (``_fp4_pairs``), one gather instead of a pass per nibble,
    mask and sign."""
    if fmt == "fp8":
        return codes.float()
    return torch.nn.functional.embedding(codes.view(torch.uint8).int(), _fp4_pairs(codes.device)).flatten(-2)


@functools.cache
def _fp4_pairs(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` fp32: the values of a packed FP4 byte's low nibble (the even column) and high nibble."""
    byte = torch.arange(256, dtype=torch.int32, device=device)
    return torch.stack([e2m1_to_float(byte & 15), e2m1_to_float(byte >> 4)], -1)


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor's shape for a ``[out, in]`` matrix in blocks of ``block``."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])
