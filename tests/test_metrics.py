"""harness/loop/metrics.py: combining micro-batch metrics, the sampler/trainer mismatch, the progress bar, each
phase's own peak memory."""

import math
import mmap
import os

import pytest
import torch

from harness.loop.metrics import CLEAR_REFS, MetricMeter, MismatchMeter, PhaseMemory, peak_memory_mb, progress_fields

CPU = torch.device("cpu")


@pytest.mark.slow  # allocates and frees hundreds of MB: make test
@pytest.mark.skipif(not os.access(CLEAR_REFS, os.W_OK), reason="the kernel's peak RSS cannot be reset here")
def test_a_phase_peak_is_its_own_not_the_process_peak_before_it():
    memory = PhaseMemory(CPU)
    memory.start("big")
    # 256 MiB mapped, touched and unmapped outside malloc (harness/run/allocator.py's setting keeps freed blocks)
    block, page = mmap.mmap(-1, 256 * 2**20), b"\1" * 2**20
    for _ in range(256):
        block.write(page)
    block.close()
    memory.start("small")
    torch.ones(2**10).sum()
    got = memory.metrics()
    assert got["peak_mem_big_mb"] - got["peak_mem_small_mb"] > 200
    assert got["peak_mem_mb"] == got["peak_mem_big_mb"] and got["peak_mem_small_mb"] <= peak_memory_mb(CPU) + 1
    assert set(memory.metrics(total=False)) == {"peak_mem_big_mb", "peak_mem_small_mb"}


def test_the_metric_meter_takes_extremes_token_means_and_minibatch_shares():
    """*_min / *_max by min / max; other keys by a token-weighted mean that skips non-finite values; a minibatch
    share (pg_loss) as the mean over optimizer steps of the sums of their micro-batches' shares; a key whose
    weights are all 0 is left out."""
    meter = MetricMeter(shares=frozenset({"pg_loss"}))
    # optimizer step A: micro-batches of 2 and 6 of its 8 tokens (pg_loss 0.25 + 0.5); step B: one of 4 (1.0)
    meter.add({"ratio_min": 0.9, "ratio_max": 1.1, "entropy": 1.0, "pg_loss": 0.25, "kl": 0.5}, 2, step_tokens=8)
    meter.add({"ratio_min": 0.8, "ratio_max": 1.3, "entropy": 2.0, "pg_loss": 0.5, "kl": float("nan")}, 6, 8)
    meter.add({"ratio_min": 0.95, "ratio_max": 1.05, "entropy": 4.0, "pg_loss": 1.0, "kl": 1.0}, 4, step_tokens=4)
    meter.add({"empty": 3.0}, 0)
    assert meter.result() == pytest.approx({"ratio_min": 0.8, "ratio_max": 1.3, "entropy": 2.5, "pg_loss": 0.875,
                                            "kl": 5 / 6})


def test_the_mismatch_meter_is_the_k3_estimate_of_kl_behaviour_to_trainer_over_valid_tokens():
    """w = pi_trainer / pi_sampler on tokens the sampler drew: KL(sampler || trainer) ~ E[w - 1 - log w]; padding
    (mask 0) is left out of every mean."""
    sampler = torch.tensor([[-1.0, -2.0, -0.5]])
    log_w = torch.tensor([[math.log(2.0), math.log(4.0), 7.0]])
    meter = MismatchMeter()
    meter.add(sampler, sampler + log_w, torch.tensor([[True, True, False]]))
    w = torch.tensor([2.0, 4.0], dtype=torch.float64)
    assert meter.result() == pytest.approx({"mismatch_logp_abs": w.log().mean().item(),
                                            "mismatch_kl": (w - 1 - w.log()).mean().item()})


def test_the_progress_bar_shows_the_latest_evaluation():
    rows = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1}, {"step": 2, "eval_accuracy": 0.5}, {"step": 3}]
    assert progress_fields({"reward_mean": 0.25}, rows) == {"reward": "0.250", "eval": "0.500"}


def test_a_phase_run_twice_in_a_step_keeps_its_larger_peak(monkeypatch):
    """TRL's step may sample and update more than once: a phase's peak is the largest of its runs, not the last."""
    import harness.loop.metrics as metrics

    peaks = iter([300.0, 100.0, 120.0, 90.0])  # rollout, update, rollout again, update again
    monkeypatch.setattr(metrics, "peak_memory_mb", lambda device: next(peaks))
    monkeypatch.setattr(metrics, "reset_peak_memory", lambda device: None)
    memory = PhaseMemory(CPU)
    for phase in ("rollout", "update", "rollout", "update"):
        memory.start(phase)
    assert memory.metrics() == {"peak_mem_rollout_mb": 300.0, "peak_mem_update_mb": 100.0, "peak_mem_mb": 300.0}
