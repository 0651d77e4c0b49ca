"""Watching a training run from outside its training code.

The notebooks' training loops hold the tutorial's steps; what a run also needs (a progress line per logging
interval, the curve in MLflow, what each worker measured) comes from two objects:

- `watch(...)`, in the driver: a `Watch`, which goes to the workers in the training config. It owns the
  run's `RunLog` actor, which outlives the workers and logs to MLflow from a thread of its own, and, as a
  context manager around `trainer.fit()`, prints the run's lines in the training cell.
- `Observer(watch, model)`, in each worker: the loop calls `observer.step(step, loss)` once per optimizer
  step, where the original printed its loss. It returns the loss averaged over the workers.

An observer can never fail or stall a step. It calls the actor without waiting for an answer, and never
MLflow. Each of its parts
catches its own errors, and the first one becomes one warning line in the training cell; training goes on.
Its one collective, the loss average, runs on the loss's own device (a GPU's for NCCL), like the step's own
collectives: a worker that died fails it as it fails the step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

__all__ = ["Watch", "watch", "Observer", "lightning_observer", "trainer_observer"]


@dataclass
class Watch:
    """The run's observers' shared state: the `RunLog` actor and the MLflow run."""

    run_log: object
    mlflow_run_id: str | None
    total_steps: int | None = None
    print_every: int = 1
    seconds: float = 0.0  # how long the run trained: the time inside `with watch:`
    _progress: object = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:  # to the workers: not the driver's printing thread
        return {**self.__dict__, "_progress": None}

    def __enter__(self) -> Watch:
        from harness.run_log import show_progress

        self._progress = show_progress(self.run_log)
        self._progress.__enter__()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import ray

        self.seconds = round(time.perf_counter() - self._started, 2)
        with contextlib.suppress(Exception):  # the metrics still on their way to MLflow: a bounded wait
            ray.get(self.run_log.flush_tracking.remote(10.0), timeout=20)
        self._progress.__exit__(*exc)

    def resumed(self, total_steps: int) -> Watch:
        """A watch for a run that continues this one from its checkpoint, up to `total_steps`: the same
        MLflow run and progress lines."""
        from harness.run_log import run_log

        log = run_log(total_steps, self.print_every, self.mlflow_run_id)
        return Watch(log, self.mlflow_run_id, total_steps, self.print_every)

    def _get(self, method: str):
        import ray

        return ray.get(getattr(self.run_log, method).remote())

    def losses(self) -> list[float]:
        """The global batch's loss at each step; a step run twice counts with its last attempt's value."""
        return self._get("losses")

    def attempts(self) -> list[dict]:
        """Each worker group's start step, size, facts and losses (`RunLog.attempt_losses`)."""
        return self._get("attempt_losses")

    def evaluations(self) -> dict[int, dict]:
        """Each evaluation's numbers by step, as the observers sent them (e.g. {"val_loss": ...})."""
        return self._get("evaluation_history")

    def ranks(self) -> list[dict]:
        """What each rank measured at its attempt's first step: `node_id`, and per framework its share."""
        return self._get("ranks")

    def kill_summary(self) -> dict | None:
        """A kill from outside and the resume that followed (`RunLog.kill_summary`); None without one."""
        return self._get("kill_summary")

    def workers(self, plan=None):
        """What each worker held, one row per rank (a `DataFrame`): its Ray node, its share of what the
        framework shards, the megabytes of its weights, optimizer state and gradients, and with `plan`
        (the Set up cell's) a last row of what the plan counted per rank."""
        import pandas as pd

        rows = {f"rank {rank}": _held(facts) for rank, facts in enumerate(self.ranks())}
        measured = {column for row in rows.values() for column in row}
        if plan is not None:  # what the plan counted of what the ranks measured
            planned = plan.as_dict()
            rows["plan"] = {
                f"{what} (MB)": planned[f"{key}_bytes_per_rank"] / 1e6
                for key, what in _HELD.items()
                if f"{key}_bytes_per_rank" in planned and f"{what} (MB)" in measured
            }
        return pd.DataFrame.from_dict(rows, orient="index").round(3).fillna("")


def watch(
    notebook: str,
    namespace: dict,
    total_steps: int,
    *,
    print_every: int | None = None,
    mlflow_run_id: str | None = None,
) -> Watch:
    """In the driver, before `fit()`: the run's `Watch`.

    `namespace`, the notebook's `globals()`. A progress line comes every `LOGGING_STEPS` steps where the
    notebook has that parameter (else `print_every`, else about six lines a run). A new MLflow run records
    the notebook's parameters, unless `mlflow_run_id` continues one (a resumed run)."""
    from harness.run_log import run_log

    if print_every is None:
        print_every = namespace.get("LOGGING_STEPS") or max(1, total_steps // 6)
    run_id = mlflow_run_id or _start_run(notebook, namespace)
    log = run_log(total_steps, print_every, run_id, notebook=notebook)
    return Watch(log, run_id, total_steps, print_every)


def _start_run(notebook: str, namespace: dict) -> str | None:
    """A new MLflow run, within a bounded wait: a tracking server that stopped answering since the Set up
    cell costs the run its record there (one line says so), never the training."""
    from .tracking import best_effort, start_run

    return best_effort(
        lambda: start_run(notebook, namespace),
        lambda uri, error: f"MLflow at {uri} did not answer ({error}): this run is not tracked.",
    )


_SHARES = {  # what each framework's observer calls a rank's share of what it shards
    "param_shard_fraction": "share of the parameters",
    "shard_fraction": "share of the parameters",
    "partition_fraction": "share of the partitioned state",
}
_HELD = {"param": "weights", "optimizer": "optimizer state", "grad": "gradients"}


def _held(facts: dict) -> dict:
    """One rank's row of `Watch.workers`."""
    row = {"Ray node": str(facts.get("node_id", ""))[:8]}
    row.update({shown: facts[key] for key, shown in _SHARES.items() if key in facts})
    for key, what in _HELD.items():
        value = (facts.get("state_bytes") or {}).get(f"{key}_bytes")
        if value is not None:
            row[f"{what} (MB)"] = value / 1e6
    return row


class _ObserverBase:
    """What every framework's observer does, whatever calls it: the attempt's start and each rank's facts,
    the loss averaged over the workers, and one warning line for the first error."""

    def _watch(self, watch: Watch) -> None:
        self.watch, self.started, self.warned, self.facts = watch, False, False, {}

    def _start(self, rank: int, world_size: int, steps_done: int, facts: dict, fetched=None) -> None:
        """The attempt's first step: it starts after `steps_done` steps (0, or a checkpoint's). `fetched`,
        (bytes read, checkpoint bytes) of the checkpoint it resumed from, where the caller knows them; else
        what this process last read through `harness.storage` (`take_last_fetch`), if anything."""
        self._begin_attempt(rank, world_size, steps_done)
        self._send_facts(facts, fetched)

    def _begin_attempt(
        self, rank: int, world_size: int, steps_done: int, wait: bool = False, **facts
    ) -> None:
        """Rank 0: a new worker group started after `steps_done` steps. `wait`: until the run log has it
        (at most 10 s), so that the facts every rank sends after the next collective land in this attempt."""
        import ray

        self.rank, self.world_size, self.started = rank, world_size, True
        if rank == 0:  # calls from one process reach the actor in order: the attempt before its steps
            begun = self.watch.run_log.start_attempt.remote(steps_done, world_size, **facts)
            if wait:
                ray.get(begun, timeout=10)

    def _send_facts(self, facts: dict, fetched=None) -> None:
        """What this rank measured at its attempt's first step, its Ray node, and what it read to resume."""
        import ray

        from harness.storage import take_last_fetch

        self.started = True
        # its node, and its process: what a test that kills a worker from outside needs to find it
        self.facts = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), **facts}
        fetched = fetched or take_last_fetch()  # what this worker read of the checkpoint it resumed from
        if fetched:
            self.facts.update(resume_bytes=fetched[0], checkpoint_bytes=fetched[1])
        self.watch.run_log.rank_facts.remote(self.rank, self.facts)

    def _more_facts(self, **facts) -> None:
        self.facts.update(facts)
        self.watch.run_log.rank_facts.remote(self.rank, self.facts)

    def _average(self, loss) -> float:
        """The loss of the global batch: a collective as the step's own are (a dead peer fails both alike)."""
        import torch.distributed as dist

        value = loss.detach().float().clone()  # on the loss's device, as NCCL needs
        if self.world_size == 1 or not dist.is_initialized():
            return value.item()
        dist.all_reduce(value)  # a sum: gloo has no average
        return value.item() / self.world_size

    def _evaluated(self, step: int, numbers: dict, line: str = "") -> None:
        """Rank 0: an evaluation's `numbers` after step `step`: a progress line (by default, each number),
        MLflow and `Watch.evaluations`."""
        log = self.watch.run_log
        line = line or f"evaluated at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in numbers.items())
        self._safely("the run log", lambda: (log.say.remote(line), log.track.remote(step, numbers)))

    def _log(self, step: int, loss: float, seconds: float | None = None, **shown) -> None:
        if self.rank == 0:
            log = self.watch.run_log.log
            self._safely("the run log", lambda: log.remote(step, loss, _seconds=seconds, **shown))

    def _safely(self, what: str, call, *args):
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - an observer never fails a step
            if not self.warned:
                self.warned = True
                rank = getattr(self, "rank", "?")
                line = (
                    f"warning: rank {rank}: {what} failed ({exc.__class__.__name__}: {exc}); training goes on"
                )
                print(line, file=sys.stderr, flush=True)
                with contextlib.suppress(Exception):
                    self.watch.run_log.say.remote(line)
            return None


class Observer(_ObserverBase):
    """For a plain training loop, in each worker: `step(step, loss)` once per optimizer step, on every rank
    (the loss average is a collective).

    `model` and `optimizer`, what the loop trains, for what is measured at the attempt's first step: a
    DeepSpeed engine's share of the partitioned state and the bytes it holds; for a model of `DTensor`
    shards (FSDP2), its share of the parameters, the bytes of its weights, optimizer state and gradients
    (seen by an optimizer pre-step hook, after every micro-step has accumulated), and the micro-steps per
    step (a forward pre-hook counts them). Frozen parameters (a LoRA base) are fingerprinted here and
    checked at the run's last step: `frozen_tensors_changed`. `facts`: more of this rank's, as they are.
    Each step's seconds, from one `step` call to the next, go to the run log."""

    def __init__(self, watch: Watch, model=None, optimizer=None, **facts) -> None:
        import time

        import ray.train

        context = ray.train.get_context()
        self._watch(watch)
        self.model, self.optimizer, self.given = model, optimizer, facts
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.micro_steps, self.grad_bytes, self.frozen = 0, None, None
        self._safely("watching the model", self._hook)
        self.last = time.perf_counter()

    def _hook(self) -> None:
        if self.model is None or hasattr(self.model, "zero_optimization_stage"):
            return
        from basics.sharding import frozen_fingerprint

        self.model.register_forward_pre_hook(self._count)
        if self.optimizer is not None:
            self._pre_step = self.optimizer.register_step_pre_hook(self._gradients)
        if any(not p.requires_grad for p in self.model.parameters()):
            self.frozen = frozen_fingerprint(self.model)

    def _count(self, module, args) -> None:
        self.micro_steps += 1

    def _gradients(self, optimizer, args, kwargs) -> None:  # once, before the attempt's first update
        from basics.sharding import gradient_bytes

        self._pre_step.remove()
        self.grad_bytes = self._safely("measuring the gradients", gradient_bytes, self.model)

    def _facts(self) -> dict:
        facts = _model_facts(self.model)
        if self.model is not None and "partition_fraction" not in facts:
            import torch

            from basics.flops import dense_peak_flops
            from basics.plan import state_bytes
            from basics.sharding import param_shard_fraction

            params = list(self.model.parameters())
            total = sum(p.numel() for p in params)  # a DTensor's numel() is the whole parameter's
            facts = {
                "num_params": total,
                "trainable_params": sum(p.numel() for p in params if p.requires_grad),
                "shard_fraction": param_shard_fraction(self.model, total),
                "threads": torch.get_num_threads(),
                "peak_flops": dense_peak_flops(params[0].device, torch.bfloat16),  # None: not a known GPU
            }
            if self.optimizer is not None:
                facts["state_bytes"] = {
                    **state_bytes(self.model, self.optimizer),
                    "grad_bytes": self.grad_bytes,
                }
        return {**facts, **self.given}

    def step(self, step: int, loss, **shown) -> float:
        """Step `step` (counted from 1 over the whole run) ended with this worker's `loss` (a tensor);
        `shown` (e.g. `lr=...`) goes on its progress line and to MLflow. Returns the loss averaged over the
        workers."""
        import time

        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        micro_steps, self.micro_steps = self.micro_steps, 0
        first = not self.started
        if first:  # rank 0 first: every rank's facts, sent after the loss average below, land in this attempt
            counted = {"micro_steps": micro_steps} if micro_steps else {}
            begin = self._begin_attempt
            self._safely("the run log", lambda: begin(self.rank, self.world_size, step - 1, True, **counted))
        value = self._average(loss)
        if first:
            facts = self._safely("measuring the model", self._facts) or dict(self.given)
            self._safely("the run log", self._send_facts, facts)
        if self.frozen is not None and step == self.watch.total_steps:
            from basics.sharding import frozen_tensors_changed

            changed = self._safely(
                "checking the frozen weights", frozen_tensors_changed, self.model, self.frozen
            )
            self._safely("the run log", lambda: self._more_facts(frozen_tensors_changed=changed))
        self._log(step, value, seconds=seconds, **shown)
        return value

    def evaluation(self, step: int, **numbers) -> None:
        """An evaluation after step `step` (e.g. `eval_loss=...`, the same number on every rank): a progress
        line, MLflow and `Watch.evaluations`. Its time is counted apart (`eval_seconds`), not in a step's."""
        import time

        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.rank == 0:
            self._evaluated(step, {**numbers, "eval_seconds": seconds})


def _bytes_read(ckpt_path) -> tuple[int, int] | None:
    """(bytes read, the checkpoint's bytes) of the checkpoint Lightning resumed from in place (a
    `harness.storage.StoredFolder`), or None: no resume, or a path of another kind."""
    read = getattr(ckpt_path, "bytes_read", None)
    return None if read is None else (read, ckpt_path.checkpoint_bytes)


def lightning_observer(watch: Watch):
    """For Lightning (a `Callback`, given to `pl.Trainer(callbacks=...)`): what `Observer` does, from
    Lightning's hooks. At the attempt's start each rank records its node, its share of the parameters after
    FSDP sharded them and their dtypes; after the first step, the bytes its shards hold."""
    import lightning.pytorch as pl

    class LightningObserver(pl.Callback, _ObserverBase):
        def __init__(self) -> None:
            self._watch(watch)
            self.num_params, self.measured = 0, False

        def setup(self, trainer, pl_module, stage: str) -> None:  # before the strategy shards the model
            self.num_params = sum(p.numel() for p in pl_module.parameters())

        def on_train_start(self, trainer, pl_module) -> None:
            from basics.sharding import param_shard_fraction

            def facts() -> dict:
                return {
                    "param_shard_fraction": param_shard_fraction(trainer.model, self.num_params),
                    "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                }

            measured = self._safely("measuring the model", facts) or {}
            fetched = _bytes_read(trainer.ckpt_path)
            start = (trainer.global_rank, trainer.world_size, trainer.global_step, measured, fetched)
            self._safely("the run log", self._start, *start)

        def on_validation_end(self, trainer, pl_module) -> None:  # each metric logged in validation
            if trainer.sanity_checking or trainer.global_rank != 0 or not self.started:
                return
            numbers = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
            self._evaluated(trainer.global_step, numbers)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not self.measured:  # after the first step: what this rank's shards hold, against the plan
                from basics.plan import state_bytes

                self.measured = True
                held = self._safely("measuring the shards", state_bytes, trainer.model, trainer.optimizers[0])
                self._safely("the run log", lambda: self._more_facts(state_bytes=held))
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self._log(trainer.global_step, self._average(loss), lr=lr)

    return LightningObserver()


def trainer_observer(watch: Watch, metric: str):
    """For the Hugging Face `Trainer` (a `TrainerCallback`, given to `trainer.add_callback`): each logged
    training loss (rank 0's, as the `Trainer` logs it) to the progress lines and MLflow, each evaluation as a
    line naming `metric` and its numbers to MLflow, and each rank's node."""
    from transformers import TrainerCallback

    class TrainerObserver(TrainerCallback, _ObserverBase):
        def __init__(self) -> None:
            self._watch(watch)

        def on_train_begin(self, args, state, control, **kwargs):
            import ray.train

            context = ray.train.get_context()
            start = (context.get_world_rank(), context.get_world_size(), state.global_step, {})
            self._safely("the run log", self._start, *start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                self._log(state.global_step, logs["loss"], lr=logs.get("learning_rate", 0.0))
            if self.rank == 0 and "eval_loss" in logs:
                line = f"evaluated at step {state.global_step}: {metric} {logs[f'eval_{metric}']:.3f}"
                numbers = {
                    k: v for k, v in logs.items() if k.startswith("eval_") and isinstance(v, int | float)
                }
                self._evaluated(state.global_step, numbers, line)

    return TrainerObserver()


def _model_facts(model) -> dict:
    """What a rank holds of the model, measured where the framework says: a DeepSpeed engine's partitioned
    share (`partition_fraction`) and bytes (`state_bytes`)."""
    if model is None:
        return {}
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        from basics.sharding import zero_partition_fraction, zero_state_bytes

        return {"partition_fraction": zero_partition_fraction(model), "state_bytes": zero_state_bytes(model)}
    return {}
