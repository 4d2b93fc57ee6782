"""NVFP4 decoding in numpy, written from docs/design.md §2 alone: the suite's oracle for the bytes the
libraries wrote, independent of megamoe and of the libraries' own decompression."""

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def e4m3_values() -> np.ndarray:
    """All 256 float8_e4m3fn bytes as float64: (8 + m) 2^(e-10), subnormal m 2^-9, S.1111.111 NaN."""
    v = np.empty(256)
    for c in range(256):
        e, m = (c >> 3) & 0xF, c & 7
        mag = np.nan if (e == 15 and m == 7) else (m * 2.0**-9 if e == 0 else (8 + m) * 2.0**(e - 10))
        v[c] = -mag if c & 0x80 else mag
    return v


E4M3 = e4m3_values()


def codes(packed: np.ndarray) -> np.ndarray:
    """[N, K/2] bytes -> [N, K] e2m1 codes; element 2j is the low nibble."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def exact(packed: np.ndarray, scales: np.ndarray, s2: float) -> np.ndarray:
    """e2m1 * ue4m3 * s2 in float64: exact (at most 2 + 4 + 24 significant bits)."""
    c = codes(packed)
    block = np.repeat(E4M3[scales], 16, axis=1)
    return E2M1[c] * block * np.float64(np.float32(s2))


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bit patterns (uint16), one round-to-nearest-even step: 8 significant
    bits, subnormal spacing 2^-133, overflow to infinity."""
    a = np.abs(x)
    _, e = np.frexp(a)  # a = f 2^e, f in [0.5, 1)
    q = np.maximum(e - 8, -133).astype(np.float64)
    n = np.rint(np.ldexp(a, -q.astype(np.int64)))  # numpy's rint rounds half to even
    with np.errstate(over="ignore"):
        v = np.copysign(np.ldexp(n, q.astype(np.int64)), x).astype(np.float32)  # exact or inf
    return (v.view(np.uint32) >> 16).astype(np.uint16)


def bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ulp_distance(a_bits: np.ndarray, b_bits: np.ndarray) -> np.ndarray:
    """|a - b| in bf16 ulps for finite values of one sign (ordered bit patterns)."""
    def ordered(b):
        b = b.astype(np.int64)
        return np.where(b & 0x8000, -(b & 0x7FFF), b)
    return np.abs(ordered(a_bits) - ordered(b_bits))
