"""Llama 3.1's "llama3" RoPE scaling from a GGUF: llama.cpp stores it as a table of per-frequency
factors (`rope_freqs.weight`) and no metadata; these recover the parameters that give the same
frequencies, checked by recomputing every one (controller.cli.gguf_convert calls them)."""
from __future__ import annotations

from logicpipe.common.modeldir import ModelError


def llama3_inv_freq(theta: float, dim: int, factor: float, low: float, high: float, original: int):
    """HF's inverse frequencies [dim // 2] (float64 numpy) of a "llama3" RoPE scaling."""
    import numpy as np

    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def llama3_rope(factors, theta: float, dim: int, where: str) -> dict | None:
    """The "llama3" rope_parameters (less rope_theta) whose inverse frequencies are llama.cpp's: the
    plain ones divided by `factors` ([dim // 2], its rope_freqs table); None where every factor is 1
    (no scaling). llama.cpp writes the table from (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) and no metadata; they are recovered here (the table fixes
    the band edges only as original / low and original / high: the original context is taken as
    Llama 3.1's 8192 and the two factors fitted to the smoothed band) and checked by recomputing
    every frequency; a table no such parameters give is refused."""
    import numpy as np

    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != dim // 2 or not np.all(np.isfinite(f)) or f.min() <= 0:
        raise ModelError(f"{where}: {f.size} factors for a RoPE of {dim} dims; expected {dim // 2} positive ones")
    if np.allclose(f, 1.0, rtol=0, atol=1e-7):
        return None
    factor, original = float(f.max()), 8192
    want = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim) / f
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2
    medium = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if medium.sum() >= 2:  # 1 / f = (1 - s) / factor + s, s linear in 1 / wavelen: fit its two factors
        inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        s = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv[medium] / (2 * np.pi), s, 1)  # s = original / (high - low) / wavelen - ...
        if slope > 0:
            span = original / slope
            low = -intercept * span
            candidates.append((round(low, 6), round(low + span, 6)))
    for low, high in candidates:
        if 0 < low < high:
            got = llama3_inv_freq(theta, dim, factor, low, high, original)
            if np.allclose(got, want, rtol=1e-5, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    raise ModelError(f"{where}: the RoPE factors are no llama3 scaling (factor {factor:g}, tried low/high frequency "
                     f"factors {', '.join(f'{lo:g}/{hi:g}' for lo, hi in candidates)}); not supported")
