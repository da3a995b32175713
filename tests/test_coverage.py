"""The report's accuracy intervals hold what they claim: runs simulated from known distributions, and the share of
simulations whose reported 95% interval holds the true value (its empirical coverage) measured at 3, 5 and 10 seeds.

Each simulated run scores a shared eval set of PROBLEMS problems: problem p is solved by seed s with probability
expit(mu + s_seed + b_problem) (seed and problem effects normal on the logit scale), so the seeds' spread and the eval
set's sampling both matter, in the proportions of each case. The truth (the accuracy over the population of seeds and
problems) is integrated by Gauss–Hermite quadrature. A method reaches its level at n seeds when its coverage is at
least LEVEL - 4 Monte-Carlo standard errors (SIMULATIONS simulations: the check does not hinge on the draw); the
report marks the intervals of fewer seeds than analysis.stats.INDICATIVE_BELOW "indicative", so from there on every
case must reach it, and below it the measured coverage is what the mark stands for.
"""

import numpy as np
import pytest
from numpy.polynomial.hermite_e import hermegauss
from scipy.special import expit

from analysis.stats import BOOT_SEED, HIERARCHY, INDICATIVE_BELOW, LEVEL, N_BOOT, indicative, t_bounds, variance_parts

SIMULATIONS, PROBLEMS = 2000, 32
MCSE = np.sqrt(LEVEL * (1 - LEVEL) / SIMULATIONS)
REACHED = LEVEL - 4 * MCSE
# name: (mu, sd of the seed effect, sd of the problem effect) on the logit scale
CASES = {"seeds vary most": (-0.6, 0.5, 0.3), "problems vary most (3 seeds alike)": (-0.6, 0.05, 2.0),
         "both vary": (-0.6, 0.4, 1.5), "near the ceiling, skewed": (2.5, 0.6, 1.5)}
# a paired difference A - B: A = B's logit + delta + an objective x problem effect (sd), seeds correlated by rho
DIFFERENCES = {"A above B, problem-level differences": (-0.6, 0.3, 2.0, 0.1, 0.5, 0.5),
               "A above B, seed-level differences": (-0.6, 0.6, 1.0, 0.1, 0.2, 0.3)}


def expected(mu: float, *sds: float) -> float:
    """E[expit(mu + sum of independent N(0, sd^2))], by Gauss–Hermite quadrature (60 nodes per effect)."""
    nodes, weights = hermegauss(60)
    grids = np.meshgrid(*[nodes * sd for sd in sds], indexing="ij")
    mass = np.prod(np.meshgrid(*[weights / weights.sum()] * len(sds), indexing="ij"), axis=0)
    return float((expit(mu + sum(grids)) * mass).sum())


def simulate(rng, seeds: int, mu: float, sd_seed: float, sd_problem: float) -> np.ndarray:
    """(1 starting policy, seeds, problems, simulations) scores."""
    logit = (mu + rng.normal(0, sd_seed, (seeds, 1, SIMULATIONS))
             + rng.normal(0, sd_problem, (1, PROBLEMS, SIMULATIONS)))
    return (rng.random(logit.shape) < expit(logit)).astype(float)[None]


def simulate_difference(rng, seeds: int, mu, sd_seed, sd_problem, delta, sd_objective, rho) -> np.ndarray:
    """(1, seeds, problems, simulations) differences of A's and B's scores on the same seeds and problems."""
    seed_b = rng.normal(0, sd_seed, (seeds, 1, SIMULATIONS))
    seed_a = rho * seed_b + np.sqrt(1 - rho ** 2) * rng.normal(0, sd_seed, seed_b.shape)
    problem = rng.normal(0, sd_problem, (1, PROBLEMS, SIMULATIONS))
    own = rng.normal(0, sd_objective, problem.shape)
    a = rng.random((seeds, PROBLEMS, SIMULATIONS)) < expit(mu + delta + seed_a + problem + own)
    b = rng.random((seeds, PROBLEMS, SIMULATIONS)) < expit(mu + seed_b + problem)
    return (a.astype(float) - b)[None]


def reported_coverage(x: np.ndarray, truth: float) -> float:
    """Coverage of the report's interval (analysis.stats.variance_parts + t_bounds over HIERARCHY)."""
    low, high = t_bounds(*variance_parts(x, HIERARCHY))
    return float(np.mean((low <= truth) & (truth <= high)))


def percentile_bootstrap_coverage(x: np.ndarray, truth: float) -> float:
    """Coverage of the report's former interval: the 95% percentile bootstrap of the seeds' accuracies (N_BOOT
    resamples drawn by default_rng(BOOT_SEED), as analysis.stats.bootstrap_ci), computed exactly and fast: the draws
    are few distinct multisets of seeds, so each simulation's sorted resampled means are those multisets' means, each
    repeated as often as it was drawn, and numpy's linear percentile is read off their cumulative counts."""
    accuracies = x[0].mean(axis=1).T  # (simulations, seeds)
    seeds = accuracies.shape[1]
    index = np.random.default_rng(BOOT_SEED).integers(0, seeds, size=(N_BOOT, seeds))
    multisets, counts = np.unique(np.sort(index, axis=1), axis=0, return_counts=True)
    means = accuracies[:, multisets].mean(axis=2)  # (simulations, multisets)
    order = np.argsort(means, axis=1, kind="stable")
    values, ends = np.take_along_axis(means, order, axis=1), np.cumsum(counts[order], axis=1)
    rows = np.arange(len(values))

    def sorted_at(position: int) -> np.ndarray:  # the resampled mean at this place in each sorted sample
        return values[rows, (ends <= position).sum(axis=1)]

    bounds = []
    for q in (0.5 - LEVEL / 2, 0.5 + LEVEL / 2):
        place = (N_BOOT - 1) * q
        below = int(np.floor(place))
        bounds.append(sorted_at(below) + (place - below) * (sorted_at(below + 1) - sorted_at(below)))
    return float(np.mean((bounds[0] <= truth) & (truth <= bounds[1])))


def cases():
    """(name, seeds, scores, truth) of every simulated case, from one fixed random stream."""
    rng = np.random.default_rng(2026)
    for seeds in (3, 5, 10):
        for name, (mu, sd_seed, sd_problem) in CASES.items():
            yield name, seeds, simulate(rng, seeds, mu, sd_seed, sd_problem), expected(mu, sd_seed, sd_problem)
        for name, (mu, sd_seed, sd_problem, delta, sd_own, rho) in DIFFERENCES.items():
            truth = expected(mu + delta, sd_seed, sd_problem, sd_own) - expected(mu, sd_seed, sd_problem)
            yield name, seeds, simulate_difference(rng, seeds, mu, sd_seed, sd_problem, delta, sd_own, rho), truth


@pytest.fixture(scope="module")
def measured():
    return [(name, seeds, reported_coverage(x, truth), percentile_bootstrap_coverage(x, truth) if seeds == 3
             else np.nan) for name, seeds, x, truth in cases()]


@pytest.mark.slow
def test_the_reported_interval_reaches_95_percent_wherever_it_is_not_marked_indicative(measured):
    short = [f"{name}, {seeds} seeds: {coverage:.3f}" for name, seeds, coverage, _ in measured
             if coverage < REACHED and not indicative(seeds)]
    assert not short, f"coverage below {REACHED:.3f} (95% - 4 MCSE) without the 'indicative' mark: {short}"
    assert not indicative(INDICATIVE_BELOW) and indicative(3)
    assert {seeds for _, seeds, _, _ in measured} == {3, 5, 10}


@pytest.mark.slow
def test_the_former_percentile_bootstrap_over_3_seeds_falls_short(measured):
    former = {name: old for name, seeds, _, old in measured if seeds == 3}
    assert max(former.values()) < REACHED, former  # in every case, far from its level


# The zoo's confirmation: a paired difference per (starting policy, seed, eval problem), tested at Holm's levels.
# Gaussian random effects on the accuracy scale, the variance components (seed in policy, problem, policy x problem,
# residual) of three comparisons of the zoo's confirmation (ANOVA estimates of code 43acf94's runs, negatives as 0),
# the starting policies' own component varied: from 3 policies it is poorly determined.
CONFIRMATION_CASES = {"popo's": (3.4e-4, 1.5e-3, 0.0, 0.076), "a2po's": (3.4e-3, 0.026, 0.026, 0.065),
                      "adaptive_entropy's": (1.0e-3, 3.2e-3, 0.011, 0.057)}
HOLM_LEVEL, CONFIRM_SIMULATIONS = 0.995, 20000  # the first level of a family of 10


def confirmation_misses(rng, policies: int, seeds: int, components, policy_sd: float) -> float:
    """The share of simulated confirmations (true difference 0) whose interval at HOLM_LEVEL misses 0."""
    sd_seed, sd_problem, sd_cross, sd_residual = np.sqrt(components)
    missed = 0
    for _ in range(CONFIRM_SIMULATIONS // 2000):
        n = 2000
        x = (rng.normal(0, policy_sd, (policies, 1, 1, n)) + rng.normal(0, sd_seed, (policies, seeds, 1, n))
             + rng.normal(0, sd_problem, (1, 1, 128, n)) + rng.normal(0, sd_cross, (policies, 1, 128, n))
             + rng.normal(0, sd_residual, (policies, seeds, 128, n)))
        low, high = t_bounds(*variance_parts(x, HIERARCHY), level=HOLM_LEVEL)
        missed += int(((low > 0) | (high < 0)).sum())
    return missed / CONFIRM_SIMULATIONS


@pytest.mark.slow  # the largest simulation here: make test
def test_the_confirmations_interval_reaches_holms_level_from_5_starting_policies():
    """From 5 starting policies x 3 seeds (the zoo's 45 runs per comparison) the interval holds the truth at Holm's
    first level within 4 Monte-Carlo standard errors in every case, where degrees of freedom that counted the eval
    problems' whole part (the policy x problem interaction too, which the policies' part already holds) did not.
    From 3 policies it falls short in some case: what "indicative" stands for."""
    rng = np.random.default_rng(2027)
    allowed = (1 - HOLM_LEVEL) + 4 * np.sqrt(HOLM_LEVEL * (1 - HOLM_LEVEL) / CONFIRM_SIMULATIONS)
    five = {(name, sd): confirmation_misses(rng, 5, 3, c, sd) for name, c in CONFIRMATION_CASES.items()
            for sd in (0.0, 0.03, 0.055)}
    assert max(five.values()) <= allowed, five
    three = {sd: confirmation_misses(rng, 3, 5, CONFIRMATION_CASES["a2po's"], sd) for sd in (0.055,)}
    assert max(three.values()) > allowed, three
    assert indicative(3) and not indicative(5)
