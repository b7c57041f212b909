"""The step-time bar: how many prompt rows a step may take beside its decode rows.

A step's time grows with its token rows (the matrix products), with the key positions its rows
attend over (each row at position p reads p + 1 keys of every layer), and with the positions its
sequences hold (each sequence's keys are gathered from the paged pool once a step, unless its rows read
the pool in place: `StepShape.in_place_rows`). At long context
the last two dominate: a 512-row prefill chunk is cheap at position 1,000 and many times the bar at
32,000. So while some sequence decodes, stage 0 sizes each prompt chunk to what is left of AIM (0.7)
x the bar after the step's decode rows (a prompt alone flows in whole chunks: nobody waits on its
steps), from this stage's cost model (aimed a little under the bar: measured steps scatter around it)

    seconds = fixed_s + rows * row_s + attended * position_s + held * held_s

whose coefficients start from the shard's shapes and a FLOP and byte rate (the prior) and are then
fitted (least squares, non-negative, the prior as a weak observation) to the steps this stage
measures (`observe`). Where the decode rows alone are over the bar (a long context on a slow
device), a chunk still takes what costs at most half the bar: the step is then its decode rows'
own time + bar / 2, and the prompt keeps moving. Later stages merge received steps only while the
merged step stays under the bar by the same model.

Pure arithmetic, no torch: the scheduler asks, the engine observes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STEP_BAR_S = 0.100       # --max-step-ms: a step (decode rows and a prefill chunk) takes at most this long
AIM = 0.7                # chunks are sized to this share of the bar: measured steps scatter around the model
                         # (on the H100 at 128k, aimed at the bar itself, 175 of 462 went over it, by up to 62%;
                         # on 16 CPU cores at 32k, aimed at 0.8, 10 of 250 by up to 15%, measured / modelled up to
                         # 1.39 (--step-log); at 0.7 none of 370 and 371 on the H200 at 128k)
MIN_CHUNK = 16           # prompt rows a step takes however costly they are (a prompt always moves)
FIXED_S = {"cpu": 0.002, "cuda": 0.0005}   # a step's cost beyond its FLOPs (launches, packing, the hop)
FLOPS = {"cpu": 5e10, "cuda": 2e14}        # the prior FLOP rate before any step is measured
BYTES = {"cpu": 5e9, "cuda": 1e12}         # ... and the rate keys are gathered at, bytes/s
FIT_STEPS = 64           # the measured steps the fit keeps (the newest)
PRIOR_WEIGHT = 2.0       # the prior counts as this many steps in the fit
REFIT_EVERY = 8          # once FIT_STEPS are measured, the model is fitted again every this many steps,
SURPRISE = 1.15          # ... and at once after a step that took this many times what the model said
                         # (a cost that jumps: the next chunks are sized by the step that showed it)
MIN_OBSERVED_S = 0.002   # steps shorter than this say more about noise than about rows and positions


@dataclass(frozen=True)
class StepShape:
    """What a step of this stage does per row and per attended key position."""

    row_flops: float       # FLOPs one token row costs its layers (and the head, on the last stage)
    position_flops: float  # FLOPs one row costs per key position it attends over, all its layers
    held_bytes: float = 0.0  # KV bytes one held position costs a sequence's gather, all its layers
    window: int = 0        # the positions a row attends over at most (0: all before it)
    in_place_rows: int = 0  # a sequence with at most this many rows in a step reads its keys in place: no gather


def shape_of(*, params: int, attention_layers: int, num_heads: int, kv_bytes: int, head_dim: int,
             window: int = 0, in_place_rows: int = 0) -> StepShape:
    """A shard's StepShape: 2 FLOPs per parameter per row; q.k and p.v, 2 FLOPs each per head
    element per key position per attention layer; a position's keys and values read once."""
    return StepShape(2.0 * params, 4.0 * attention_layers * num_heads * head_dim, float(kv_bytes), window,
                     in_place_rows)


def attended(start_pos: int, n: int, window: int = 0) -> int:
    """Key positions n rows at start_pos.. read in all: row p reads p + 1 (at most `window`)."""
    full = n * start_pos + n * (n + 1) // 2
    if not window:
        return full
    return sum(min(p + 1, window) for p in range(start_pos, start_pos + n)) if start_pos < window else n * window


class StepClock:
    """This stage's cost model of a step, fitted to the steps it measures."""

    def __init__(self, shape: StepShape, device_type: str = "cpu", *, bar_s: float = STEP_BAR_S,
                 flops: float = 0.0):
        self.shape = shape
        self.bar_s = bar_s                                   # 0: no bar (the token budget alone)
        rate = flops or FLOPS.get(device_type, FLOPS["cpu"])
        self.prior = (FIXED_S.get(device_type, FIXED_S["cpu"]), shape.row_flops / rate, shape.position_flops / rate,
                      shape.held_bytes / BYTES.get(device_type, BYTES["cpu"]))
        self.coef = self.prior        # (fixed_s, row_s, position_s, held_s)
        self.steps: deque[tuple[float, float, float, float]] = deque(maxlen=FIT_STEPS)  # (rows, attended, held, s)
        self.observed = 0             # steps measured

    def held(self, start_pos: int, n: int) -> int:
        """The held positions a sequence of n rows at start_pos.. costs a step: those it gathers
        (none where its rows read the pool in place, `in_place_rows`)."""
        return 0 if n <= self.shape.in_place_rows else start_pos + n

    def seconds(self, rows: int, positions: int, held: int = 0) -> float:
        """The modelled time of a step of `rows` rows attending `positions` key positions in all,
        its sequences holding `held` positions in all."""
        if rows <= 0:
            return 0.0
        c0, c1, c2, c3 = self.coef
        return c0 + rows * c1 + positions * c2 + held * c3

    def observe(self, rows: int, positions: int, held: int, seconds: float) -> None:
        """A step of this stage took `seconds`: the model is fitted again."""
        if rows <= 0 or seconds < MIN_OBSERVED_S:
            return
        surprise = seconds > SURPRISE * self.seconds(rows, positions, held)
        self.steps.append((float(rows), float(positions), float(held), seconds))
        self.observed += 1
        if self.observed <= FIT_STEPS or self.observed % REFIT_EVERY == 0 or surprise:  # a fit: ~0.2 ms of Python
            self.coef = self._fit()

    def _fit(self) -> tuple[float, float, float, float]:
        """Least squares over the kept steps, each feature scaled by its prior's share, the prior
        as PRIOR_WEIGHT steps that say "the prior is right"; a negative term is dropped."""
        # in the prior's units: x_j = feature_j * prior_j, fitted y = sum_j w_j x_j (w = 1: the prior)
        rows = [((1.0, r, a, h), t) for r, a, h, t in self.steps]
        active = [0, 1, 2, 3]
        while True:
            n = len(active)
            ata = [[0.0] * n for _ in range(n)]
            aty = [0.0] * n
            for feats, t in rows:
                x = [feats[j] * self.prior[j] for j in active]
                for i in range(n):
                    aty[i] += x[i] * t
                    for k in range(n):
                        ata[i][k] += x[i] * x[k]
            for i, j in enumerate(active):  # the prior: w_j = 1, weighted by what its feature is worth
                scale = max(ata[i][i] / max(1, len(rows)), 1e-30) * PRIOR_WEIGHT
                ata[i][i] += scale
                aty[i] += scale
            w = _solve(ata, aty)
            if w is None:
                return self.coef
            neg = [active[i] for i, x in enumerate(w) if x < 0]
            if not neg:
                out = [0.0] * 4
                for i, j in enumerate(active):
                    out[j] = w[i] * self.prior[j]
                return tuple(out)
            active = [j for j in active if j not in neg]
            if not active:
                return self.coef

    def fits(self, rows: int, positions: int, held: int = 0) -> bool:
        return not self.bar_s or self.seconds(rows, positions, held) <= self.bar_s * AIM

    def chunk(self, rows: int, positions: int, held: int, start_pos: int, most: int) -> int:
        """The most prompt rows (<= `most`) at start_pos.. a step already holding `rows` rows over
        `positions` positions (its sequences holding `held`) may take and stay under AIM x the bar; where
        that is under MIN_CHUNK, the most whose own cost is at most half of that (at least MIN_CHUNK)."""
        if most <= 0:
            return 0
        if not self.bar_s:
            return most
        w = self.shape.window

        def total(n: int) -> float:
            return self.seconds(rows + n, positions + attended(start_pos, n, w), held + self.held(start_pos, n))

        aim = self.bar_s * AIM
        n = _largest(lambda n: total(n) <= aim, most)
        if n >= min(most, MIN_CHUNK):
            return n
        alone = _largest(lambda n: total(n) - self.seconds(rows, positions, held) <= aim / 2, most)
        return max(min(most, MIN_CHUNK), alone)

    def describe(self) -> str:
        c0, c1, c2, c3 = self.coef
        return (f"{c0 * 1e3:.1f} ms + {c1 * 1e6:.1f} us/row + {c2 * 1e9:.2f} ns/attended position + "
                f"{c3 * 1e9:.1f} ns/held position ({self.observed} steps measured)"
                + (f"; bar {self.bar_s * 1e3:.0f} ms" if self.bar_s else "; no bar"))


def _largest(ok, most: int) -> int:
    """The largest n in 0..most with ok(n) (ok monotone: true up to some n), 0 if none."""
    if ok(most):
        return most
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (a small, square); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
