"""What a step costs on this replica, measured from the engine's own steps.

The KV-aware router prices a request's wait at a replica in milliseconds (`server/router/load_model.py`):
prompt blocks queued ahead x ms per prefill block, plus decode steps until a slot frees x ms per decode
step. The standalone router learns both from its own requests' first tokens; the Ray Serve request router
sees no first token and had only a prior measured on namazu-tiny on one CPU thread, which is off by an
order of magnitude on a GPU, and in the ratio of the two rates too (a GPU prefills a block in a fraction
of a decode step; a CPU in about half of one). The engine knows both exactly: every step's wall time and
the prompt tokens it computed. It fits

    ms per step = ms per decode step + ms per prefill block x (prompt blocks computed in the step)

and every replica reports the two numbers (`EngineStats`, `GET /load`, Ray Serve's routing stats).

A step's time is the span from its start to its results reaching the host: a busy engine's step starts
when the previous one's results arrived (with async scheduling it was launched before then; without, or
for a grammar sequence that waits for those results, the engine's work on them and on the next plan is
part of the step); an engine that sat idle, or whose caller paused, starts the step when it began
planning it.
"""
from __future__ import annotations

from collections.abc import Iterable


class DecayedLinearFit:
    """y ~ intercept + slope * x by least squares over exponentially decayed observations (each new one
    multiplies the weight of those before by 1 - alpha) plus fixed prior pseudo-observations (x, y,
    weight) that never decay."""

    def __init__(self, alpha: float, prior: Iterable[tuple[float, float, float]] = ()):
        if not 0 < alpha <= 1:
            raise ValueError(f"want 0 < alpha <= 1, got {alpha}")
        self.alpha = alpha
        self.set_prior(prior)
        self._sums = [0.0] * 5          # weight, sum x, sum y, sum x^2, sum x*y of the observations
        self.count = 0

    def set_prior(self, prior: Iterable[tuple[float, float, float]]) -> None:
        """Replaces the prior pseudo-observations (x, y, weight); the observations stay."""
        self._prior = [0.0] * 5
        for x, y, w in prior:
            self._prior = [a + b for a, b in zip(self._prior, (w, w * x, w * y, w * x * x, w * x * y))]

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha
        self._sums = [s * keep for s in self._sums]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += v
        self.count += 1

    def solve(self) -> tuple[float, float | None]:
        """(intercept, slope); the slope is None while every x seen is the same (no spread to fit it on),
        and the intercept is then the weighted mean of y."""
        w, sx, sy, sxx, sxy = (a + b for a, b in zip(self._sums, self._prior))
        if w <= 0:
            return 0.0, None
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(1.0, w * sxx):
            return sy / w, None
        slope = (w * sxy - sx * sy) / var
        return (sy - slope * sx) / w, slope

    def solve_nonnegative(self) -> tuple[float, float | None]:
        """The least-squares fit with intercept >= 0 and slope >= 0 (a step's time is a fixed cost plus
        a cost per block, neither negative): where the free fit breaks a bound, the best fit on that
        bound. A concave cost (prefill steps cheaper per block the more they hold) fits a negative
        intercept freely; left so, the outlier cap below fed negative times back and the fit grew
        geometrically."""
        intercept, slope = self.solve()
        if slope is None:
            return max(0.0, intercept), None
        w, sx, sy, sxx, sxy = (a + b for a, b in zip(self._sums, self._prior))
        if slope < 0:
            return max(0.0, sy / w), 0.0
        if intercept < 0:
            return 0.0, max(0.0, sxy / sxx) if sxx > 0 else 0.0
        return intercept, slope

    def intercept_at(self, slope: float) -> float:
        """The least-squares intercept once the slope is fixed at `slope` (a clamped fit's)."""
        w, sx, sy = (a + b for a, b in zip(self._sums[:3], self._prior[:3]))
        return (sy - slope * sx) / w if w > 0 else 0.0


class StepRates:
    """This engine's ms per decode step and per prefill block, from its steps (`observe`)."""

    # About the last 50 steps decide: a replica's rates move with its batch (more running sequences make
    # a decode step longer), and the router should price the batch it has now.
    ALPHA = 0.02
    # A step counts for at most this multiple of the current fit: a garbage-collection pause or another
    # process on the core is not the replica's rate. The first WARM_STEPS steps (lazy initialisation,
    # allocator growth, one-time compilation) are not counted at all.
    OUTLIER = 3.0
    WARM_STEPS = 4

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._fit = DecayedLinearFit(self.ALPHA)
        self._seen = 0

    def observe(self, prompt_tokens: int, ms: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens (prefill chunks; 0 for a step of decodes
        alone) took `ms` milliseconds."""
        self._seen += 1
        if self._seen <= self.WARM_STEPS or not ms >= 0 or prompt_tokens < 0:
            return
        blocks = prompt_tokens / self.block_size
        intercept, slope = self._fit.solve_nonnegative()
        # Without a slope yet (only decodes so far) a prefill step's time is the first news of it, not an
        # outlier of a fit that cannot predict it. The cap is at least 1 ms: never below a real time.
        if self._fit.count >= 10 and (slope is not None or blocks == 0):
            ms = min(ms, self.OUTLIER * (intercept + (slope or 0.0) * blocks) + 1.0)
        self._fit.add(blocks, ms)

    @property
    def ms_per_decode_step(self) -> float:
        """0.0 until a step was measured."""
        return self._fit.solve_nonnegative()[0] if self._fit.count else 0.0

    @property
    def ms_per_prefill_block(self) -> float:
        """0.0 until steps with and without prompt tokens were measured."""
        slope = self._fit.solve_nonnegative()[1] if self._fit.count else None
        return slope if slope is not None else 0.0
