"""The training loop: one short function that composes the components.

`train_steps` is the whole algorithm: take a batch, fit, relay the weights, log, evaluate, checkpoint. Sync and
async RL share this one body; what differs lives in the rollout source (relayrl.run.sources): a synchronous
source generates each batch on demand from the current policy, an asynchronous one keeps a producer running
beside the trainer and hands out batches within the staleness bound, with its staleness metrics. The loop asks
the source one question, `overlaps_training`, for the two things that follow from the engines' schedule: where
their step's work is measured, and whether their memory serves training until the weights come back. The loop
starts after `c.step`, the step a resumed run was checkpointed at.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from relayrl.common.device import resolve_device
from relayrl.common.files import read_jsonl
from relayrl.common.memory import memory_gb, trim_memory
from relayrl.config.schema import Config
from relayrl.run import checkpoint
from relayrl.run.build import build, build_follower
from relayrl.run.components import Components
from relayrl.run.evaluator import rollout_metrics
from relayrl.sample import Sample
from relayrl.tracking.plot import PNG, plot_run
from relayrl.tracking.progress import Progress, start_block
from relayrl.tracking.trajectories import sample_rows
from relayrl.trainer.fsdp import init_distributed, shutdown_distributed
from relayrl.trainer.leader import follow, lead, stop_followers


def train_steps(c: Components) -> dict[str, float]:
    """RL from the source's batches: synchronous (each step trains on samples from the current policy only) or
    asynchronous (rollouts never wait for training; every trained token is at most scheduler.max_staleness
    policy versions old, the rollouts running in this process or, with scheduler.placement=separate, in a
    producer process)."""
    cfg, overlap = c.cfg, c.rollouts.overlaps_training
    last_eval = _evaluate(c, 0) if cfg.eval.at_start and c.step == 0 else {}
    c.rollouts.start()
    try:
        for step in (bar := _steps(c)):
            t0, counters = time.perf_counter(), c.rollouts.engine_counters()
            batch, metrics = c.rollouts.next_batch(c.train_ctl.version)
            if c.trajectories is not None:
                c.trajectories.log(batch, step)
            metrics |= rollout_metrics(batch)
            if overlap:
                metrics |= c.train_ctl.fit(batch)
                metrics["time/weight_sync_s"] = relay_weights(c)
            else:  # the engines' work was this rollout; they idle until the weights come back
                metrics |= engine_metrics(counters, c.rollouts.engine_counters(), metrics.get("time/rollout_s"))
                metrics |= _fit_beside_idle_engines(c, batch)
            metrics |= _perf(c, metrics, time.perf_counter() - t0)
            if overlap:  # the engines generated through the whole step
                metrics |= engine_metrics(counters, c.rollouts.engine_counters(), metrics["time/step_s"])
            _log(c, step, metrics, bar, batch)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.run.steps:
                last_eval = _evaluate(c, step)
            checkpoint.save_if_due(c, step)
    finally:
        c.rollouts.stop()
    return _finish(c, last_eval)


def _fit_beside_idle_engines(c: Components, batch: list[Sample]) -> dict[str, float]:
    """Fit and relay while the engines idle: their memory serves training meanwhile (engine.release_during_train),
    and what each phase frees goes back to the system before the next needs room."""
    c.rollouts.release_memory()
    metrics = c.train_ctl.fit(batch)
    trim_memory()  # the step's activations are free: give their pages back before the engine's weights return
    metrics["time/weight_sync_s"] = relay_weights(c)
    trim_memory()  # and what the sync freed, before rollout
    return metrics


def _steps(c: Components) -> Progress:
    """The steps left, after the run's start block; a bar on a terminal, else one line per step."""
    tqdm.write(start_block(c))
    return Progress(c.step, c.cfg.run.steps)


def _finish(c: Components, last_eval: dict[str, float]) -> dict[str, float]:
    if c.cfg.eval.at_end:
        last_eval = _evaluate(c, c.cfg.run.steps)
    if c.cfg.run.save_final:
        tqdm.write(f"model saved to {c.save_model(c.run_dir / 'model')}")
    _summary(c)
    return last_eval


def _summary(c: Components) -> None:
    """The run's last lines: held-out pass@1 from the first eval to the last, and the curves drawn to a PNG
    (RUN_DIR/reward.png, as `relayrl plot RUN_DIR` draws it). Drawing never fails the run."""
    if c.logger is None:
        return
    evals = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "eval/pass@1" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        tqdm.write(f"held-out pass@1: {first['eval/pass@1']:.1%} at step {first['step']} -> "
                   f"{last['eval/pass@1']:.1%} at step {last['step']}")
    try:
        tqdm.write(f"curves: {plot_run([c.run_dir], c.run_dir / PNG)}")
    except Exception as e:  # noqa: BLE001 - a plotting problem must not fail a finished run
        tqdm.write(f"curves not drawn: {e}")


def relay_weights(c: Components) -> float:
    """The rollout side (engines here, or the producer) loads the trainer's weights; returns seconds."""
    t0 = time.perf_counter()
    c.rollouts.load_weights(c.train_ctl.weights())
    return time.perf_counter() - t0


def engine_metrics(before: dict[str, float], after: dict[str, float], span_s: float | None = None
                   ) -> dict[str, float]:
    """What the engines did between two readings of their counters: decode steps, rows per decode step (how
    full their batches ran: on a GPU a decode step costs about the same for 64 rows as for 1), busy milliseconds
    per decode step (prefills included), prompt tokens prefilled, and with `span_s` the share of that span the
    engines were busy (summed over engines). An async producer that idles (held by the staleness bound) or runs
    thin batches shows here, not in the trainer's wait: `rollout/held_frac` is the share of the span the
    staleness bound kept it from starting groups, `rollout/weight_load_s` the seconds its engines paused to load
    weights, `rollout/weight_pause_s` the part of those spent waiting for them to stop at a token boundary,
    `rollout/weight_stage_s` the seconds spent making updates ready before pausing (engines generating). No
    engine/* metrics for engines without counters (remote servers)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {}
    if "held_s" in d:  # an async producer (a sync run's weight loads are its time/weight_sync_s)
        out["rollout/weight_load_s"] = d.get("weight_update_s", 0.0)
        out["rollout/weight_pause_s"] = d.get("weight_pause_s", 0.0)
        out["rollout/weight_stage_s"] = d.get("weight_stage_s", 0.0)
        if span_s:
            out["rollout/held_frac"] = min(1.0, d["held_s"] / span_s)
    if not d.get("steps"):
        return out
    out |= {"engine/decode_steps": d["steps"], "engine/rows_per_step": d["decode_rows"] / d["steps"],
            "engine/busy_ms_per_step": 1000.0 * d["busy_s"] / d["steps"], "engine/prefill_tokens": d["prefill_tokens"]}
    if span_s:
        out["engine/busy_frac"] = d["busy_s"] / span_s
    return out


def train(cfg: Config) -> dict[str, float]:
    """Build a run from its config, train, and release every process and thread it started."""
    if cfg.train.engine == "fsdp":
        return _train_data_parallel(cfg)
    c = build(cfg, role="trainer" if cfg.scheduler.placement == "separate" else "colocated")
    print(f"run folder: {c.run_dir}")
    try:
        return train_steps(c)
    finally:
        c.close()


def _train_data_parallel(cfg: Config) -> dict[str, float]:
    """train.engine=fsdp, one process per rank (torchrun): rank 0 runs the loop above with a LeaderController,
    the other ranks follow its trainer calls (relayrl/trainer/leader.py)."""
    rank, _ = init_distributed("gloo" if resolve_device(cfg.run.device).type == "cpu" else None)  # run.device=cpu
    if rank:  # an error ends this process without the final barrier, which rank 0 may never reach (it may fail
        follow(build_follower(cfg))  # in the same command); torchrun then stops the other ranks
        shutdown_distributed()
        return {}
    try:
        try:
            c = build(cfg)  # a resume leads the trainer here already: it loads the shards on every rank
        except BaseException:
            stop_followers()  # they wait for rank 0's first command (or have failed in it and exited)
            raise
        c.train_ctl = lead(c.train_ctl)
        print(f"run folder: {c.run_dir}")
        try:
            return train_steps(c)
        finally:
            c.train_ctl.stop_followers()
            c.close()
    finally:
        shutdown_distributed()


def evaluate(cfg: Config) -> dict[str, float]:
    """Evaluate cfg.model.path (a base model or a run's saved model) on the eval set, with the run's agent."""
    c = build(cfg, role="eval")
    print(f"eval folder: {c.run_dir}")
    try:
        return _evaluate(c, 0)
    finally:
        c.close()


def _perf(c: Components, m: dict[str, float], step_s: float) -> dict[str, float]:
    return {"time/step_s": step_s,
            "perf/rollout_tokens_per_s": m.get("rollout/generated_tokens", 0.0) / max(1e-9, m["time/rollout_s"]),
            "perf/samples_per_s": m.get("rollout/samples", 0.0) / step_s,
            "version": float(c.train_ctl.version), **memory_gb()}


def _evaluate(c: Components, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics = c.rollouts.evaluate()
    if metrics:
        metrics["time/eval_s"] = time.perf_counter() - t0
        c.logger.log(step, metrics)
        shown = {k: round(v, 4) for k, v in metrics.items() if "pass" in k or "reward_mean" in k}
        tqdm.write(f"eval @ step {step}: {shown}")
    return metrics


def _log(c: Components, step: int, metrics: dict[str, float], bar: Progress, batch) -> None:
    c.logger.log(step, metrics)
    c.logger.log_samples(step, sample_rows(batch, c.tokenizer, step, c.cfg.run.samples_per_step))
    tqdm.write(c.logger.table_row(step, metrics))
    for s in batch[: c.cfg.run.print_samples]:
        tqdm.write(f"  sample (reward {s.reward:.2f}): {s.response_text[:200]!r}")
    bar.show(step, metrics)
