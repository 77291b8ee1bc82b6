"""Independent pure-Python SplitMix64 hash chain (uint64 arithmetic with Python ints)."""

M64 = (1 << 64) - 1


def mix(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform(seed, tag, *keys):
    h = mix(seed & M64)
    h = mix(h ^ tag)
    for k in keys:
        h = mix(h ^ (k & M64))
    return (h >> 11) * 2.0**-53
