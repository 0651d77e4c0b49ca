"""What a person reads while a run trains (a line per logging interval), and what a run's restarts cost.

Used through `helpers.watch` and the observers (`harness.observe`: `RunLog.log`), by the training cells
(`show_progress`), and by what kills a worker from outside a run (`RunLog.claim_kill`, `RunLog.progress`:
harness/drills.py, tests/worker_kill.py), whose results read `RunLog.kill_summary`.

When a worker process dies, its whole worker group goes with it: everything the workers held in
memory, and every metric reported since the last checkpoint. `RunLog` is a small Ray actor that the
notebook creates and owns, so it outlives the worker group: rank 0 tells it each step's loss and each
attempt's starting step (and a resuming worker, how much of the checkpoint it fetched). It also keeps the
lines the training cell shows (`show_progress` prints them from the driver while `fit()` runs): one per
logging interval, a kill, the restart and the step it resumed from. Everything else the workers print goes to the worker log file that `harness.cluster.ray_log_file`
names.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator

__all__ = [
    "RunLog",
    "run_log",
    "show_progress",
    "RUN_LOG_NAMESPACE",
    "report_collection_seconds",
]

RUN_LOG_NAMESPACE = "llm-notebooks-runs"  # where `run_log` names each run's actor


class RunLog:
    """Per-step losses of every attempt of one run, kept outside the workers (a Ray actor), and the lines
    a person reads about it.

    `total_steps` and `print_every`: a progress line for steps `print_every`, `2 * print_every`, ... and the
    last; `unit` names what a line counts ("step", or "epoch").
    """

    def __init__(
        self,
        total_steps: int | None = None,
        print_every: int = 1,
        mlflow_run_id: str | None = None,
    ) -> None:
        # each: {"resumed_from_step", "world_size", the facts it started with, "losses": {step: loss}}
        self.attempts: list[dict] = []
        self.killed_at: int | None = None
        self.total_steps = total_steps
        self.print_every = max(1, int(print_every))
        self.lines: list[str] = []  # what the training cell shows, in order
        self._fetched: dict[int, int] = {}  # rank -> bytes of the checkpoint it fetched to resume
        self._checkpoint_bytes: int | None = None
        self._ranks: dict[int, dict] = {}  # rank -> what it measured at its attempt's first step
        self.registered_step = 0  # the step of the last checkpoint Ray Train registered (`registered`)
        # MLflow, from a thread of this actor: a slow or stopped server never holds a worker.
        self._tracker = None
        self._tracked_until = 0  # the last step whose metrics went to MLflow: a replay is not logged again
        self._tracked_evaluations = 0  # the same, for `track`
        self.evaluations: dict[int, dict] = {}  # step -> an evaluation's numbers (a replay's replace them)
        if mlflow_run_id:
            from harness.tracking import BackgroundLogger

            self._tracker = BackgroundLogger(mlflow_run_id, self.lines.append)

    # ---- what the workers tell it
    def say(self, line: str) -> None:
        """A line for the training cell (an event a person should see, e.g. an evaluation); after a restart
        it names the attempt, so that an event the new worker group repeats reads as a repeat."""
        self.lines.append(f"{line}  (attempt {len(self.attempts)})" if len(self.attempts) > 1 else str(line))

    def rank_facts(self, rank: int, facts: dict) -> None:
        """What worker `rank` measured (e.g. its node, its share of the model state); a later attempt's
        facts replace an earlier one's here, and each attempt keeps its own (`attempt_losses`). Facts with
        `resume_bytes` and `checkpoint_bytes` say what the rank fetched of the checkpoint it resumed from
        (`kill_summary`); a later resume replaces its number."""
        self._ranks[int(rank)] = dict(facts)
        if self.attempts:
            self.attempts[-1]["ranks"][int(rank)] = dict(facts)
        if "resume_bytes" in facts:
            self._fetched[int(rank)] = int(facts["resume_bytes"])
            if facts.get("checkpoint_bytes") is not None:  # None: the bucket did not list it in time
                self._checkpoint_bytes = int(facts["checkpoint_bytes"])

    def start_attempt(self, resumed_from_step: int, world_size: int | None = None, **facts) -> int:
        """A worker group started (rank 0 says so), resuming after `resumed_from_step` (0: from the start),
        with `world_size` workers; `facts` (e.g. the micro-steps per step) are kept with the attempt."""
        previous = self.attempts[-1] if self.attempts else None
        self.attempts.append(
            {
                "resumed_from_step": int(resumed_from_step),
                "world_size": world_size,
                **facts,
                "losses": {},
                "step_seconds": {},
                "ranks": {},
            }
        )
        if self._tracker is not None:
            marks = {"world_size": world_size} if world_size is not None else {}
            if resumed_from_step or previous is not None:
                marks["resumed_from_step"] = int(resumed_from_step)
            if marks:
                self._tracker.mark(int(resumed_from_step), marks)
        if previous is not None:
            where = (
                f"from the checkpoint at step {resumed_from_step}"
                if resumed_from_step
                else "from the start: no checkpoint had been reported yet"
            )
            size = ""
            if world_size is not None and previous.get("world_size") not in (None, world_size):
                size = (
                    f" of {world_size} worker{'s' if world_size != 1 else ''} (was {previous['world_size']})"
                )
            self.lines.append(
                f"Ray Train started a new worker group{size} (attempt {len(self.attempts)}); it resumes {where}"
            )
        return len(self.attempts)

    def log(self, step: int, loss: float, _seconds: float | None = None, **extra) -> None:
        """Rank 0: step `step` (counted from 1) ended with `loss`, `_seconds` after the one before; `extra`
        (e.g. lr=...) shows on its line."""
        self.attempts[-1]["losses"][int(step)] = float(loss)
        if _seconds is not None:
            self.attempts[-1]["step_seconds"][int(step)] = float(_seconds)
        if self._tracker is not None and step > self._tracked_until:
            numbers = {k: float(v) for k, v in extra.items() if isinstance(v, int | float)}
            self._tracker.log(int(step), {"loss": float(loss), **numbers})
            self._tracked_until = int(step)
        first_of_attempt = len(self.attempts[-1]["losses"]) == 1 and len(self.attempts) > 1
        if step % self.print_every == 0 or step == self.total_steps or first_of_attempt:
            total = f"/{self.total_steps}" if self.total_steps else ""
            more = "".join(f"  {k} {_fmt(v)}" for k, v in extra.items())
            self.say(f"step {step}{total}  loss {loss:.4f}{more}")  # names the attempt after a restart

    def track(self, step: int, metrics: dict) -> None:
        """Numbers other than a step's loss (e.g. an evaluation's) to MLflow, at `step`, once per step; kept
        for `evaluation_history`."""
        numbers = self.evaluations[int(step)] = {k: float(v) for k, v in metrics.items()}
        if self._tracker is not None and step > self._tracked_evaluations:
            self._tracker.log(int(step), dict(numbers))
            self._tracked_evaluations = int(step)

    def claim_kill(self, step: int, by: str = "a worker's process is killed") -> bool:
        """True for the first caller only: the kill happens once per run, not again after the restart. `by`
        says who kills (a test that kills a worker from outside names itself)."""
        if self.killed_at is not None:
            return False
        self.killed_at = int(step)
        self.say(f"{by} (SIGKILL) at step {step}: the worker group fails")
        return True

    def registered(self, step: int) -> None:
        """Ray Train's controller registered the checkpoint of `step` (`harness.drills.registered_checkpoints`):
        a restart from now on resumes there."""
        self.registered_step = int(step)

    def progress(self) -> dict:
        """Where the run is, for a watcher outside it: the attempts so far, the latest's last step logged and
        world size, each rank's latest facts (its node and process), and the last registered checkpoint's
        step (0: none, or none reported to this log)."""
        latest = self.attempts[-1] if self.attempts else {"losses": {}, "ranks": {}, "world_size": None}
        return {
            "attempts": len(self.attempts),
            "last_step": max(latest["losses"], default=0),
            "world_size": latest["world_size"],
            "ranks": self.ranks(),  # each rank's latest facts
            "registered_step": self.registered_step,
        }

    # ---- what the notebook reads
    def flush_tracking(self, timeout: float = 10.0) -> int:
        """Wait at most `timeout` s for the metrics still on their way to MLflow; return how many are left
        (a warning line says so)."""
        return self._tracker.flush(timeout) if self._tracker is not None else 0

    def evaluation_history(self) -> dict[int, dict]:
        """Each evaluation's numbers (`track`), by step."""
        return dict(sorted(self.evaluations.items()))

    def ranks(self) -> list[dict]:
        """Each rank's facts (`rank_facts`), by rank."""
        return [self._ranks[r] for r in sorted(self._ranks)]

    def lines_since(self, index: int) -> list[str]:
        return self.lines[index:]

    def losses(self) -> list[float]:
        """The run's losses by step; a step run twice counts with its last attempt's value."""
        merged: dict[int, float] = {}
        for attempt in self.attempts:
            merged.update(attempt["losses"])
        return [merged[s] for s in sorted(merged)]

    def attempt_losses(self) -> list[dict]:
        """Each attempt: `resumed_from_step`, `world_size`, the facts it was started with, `losses` and
        `step_seconds` ({step as a string: value}, as JSON keeps it), and `ranks`, what each rank measured
        (by rank); where its ranks read a checkpoint to resume, `resume_bytes_per_rank` and
        `checkpoint_bytes`."""
        out = []
        for a in self.attempts:
            ranks = [a["ranks"][r] for r in sorted(a["ranks"])]
            attempt = {
                **a,
                "losses": {str(k): v for k, v in a["losses"].items()},
                "step_seconds": {str(k): v for k, v in a["step_seconds"].items()},
                "ranks": ranks,
            }
            if ranks and all("resume_bytes" in r for r in ranks):
                attempt["resume_bytes_per_rank"] = [r["resume_bytes"] for r in ranks]
                attempt["checkpoint_bytes"] = ranks[0]["checkpoint_bytes"]
            out.append(attempt)
        return out

    def kill_summary(self) -> dict | None:
        """`{"at_step", "resumed_from_step", "restarts", "replayed_steps", "replayed_max_abs_diff"}`, and
        where the workers said what they fetched to resume (`rank_facts`), `"resume_bytes_per_rank"`
        (by rank) and `"checkpoint_bytes"`."""
        if self.killed_at is None:
            return None
        first, last = self.attempts[0]["losses"], self.attempts[-1]["losses"]
        replayed = sorted(set(first) & set(last)) if len(self.attempts) > 1 else []
        summary = {
            "at_step": self.killed_at,
            "resumed_from_step": self.attempts[-1]["resumed_from_step"],
            "restarts": len(self.attempts) - 1,
            "replayed_steps": replayed,
            "replayed_max_abs_diff": max((abs(first[s] - last[s]) for s in replayed), default=None),
        }
        if self._fetched:
            summary["resume_bytes_per_rank"] = [self._fetched[r] for r in sorted(self._fetched)]
            summary["checkpoint_bytes"] = self._checkpoint_bytes
        return summary


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 1e-2 else f"{value:.4g}"
    return str(value)


def run_log(
    total_steps: int | None = None,
    print_every: int = 1,
    mlflow_run_id: str | None = None,
    notebook: str = "notebook",
):
    """Create the notebook's `RunLog` actor (no CPU reserved: it only stores a few numbers), named
    `run_log:<notebook>:<id>` in the namespace `RUN_LOG_NAMESPACE`: a process outside the notebook (a test
    that kills a worker, as Ray's chaos tests do) finds it there.

    It is placed on the head node, where the notebook's driver runs: an actor on a worker node would die
    with that node, and every later attempt of the run would fail on it.
    """
    import ray

    actor = ray.remote(num_cpus=0)(RunLog)
    head = {"node:__internal_head__": 0.001} if "node:__internal_head__" in ray.cluster_resources() else {}
    name = f"run_log:{notebook}:{uuid.uuid4().hex[:8]}"
    return actor.options(resources=head, name=name, namespace=RUN_LOG_NAMESPACE).remote(
        total_steps, print_every, mlflow_run_id
    )


@contextlib.contextmanager
def show_progress(run_log, poll_seconds: float = 0.5) -> Iterator[None]:
    """Print the run log's lines here, in the training cell, while the block (`trainer.fit()`) runs.

    The lines come from the driver, so they land in this cell in order, and the last ones are printed
    before the block's result: a line per logging interval, the kill, the restart and its step.
    """
    import ray

    printed = 0
    stop = threading.Event()

    def flush() -> None:
        nonlocal printed
        from harness.storage import shown

        lines = ray.get(run_log.lines_since.remote(printed))
        for line in lines:
            print(shown(line), flush=True)  # a checkpoint's path: `~/...`
        printed += len(lines)

    def follow() -> None:
        while not stop.wait(poll_seconds):
            with contextlib.suppress(Exception):  # the next poll, or the final flush, catches up
                flush()

    thread = threading.Thread(target=follow, name="show_progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        flush()


def report_collection_seconds() -> float:
    """Two of Ray Train's report-collection intervals, in seconds: how long a kill from outside waits after
    a checkpoint's report, so that the restart resumes from it.

    Ray Train's controller collects the workers' reports when it polls them, every
    `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (2 s by default; the laptop's Ray uses 0.5 s). A worker that
    dies sooner after a checkpoint's report can take that checkpoint with it, and the run then resumes
    from the one before: seen with GLUE's 30 ms steps, and with GPT-2's (0.1 s) once in a dozen runs.
    """
    return 2 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
