"""A worker killed for real, and a record of what Ray Train did about it.

Used by the training functions of the GPT-2, Dolly, Llama and GLUE notebooks (`KILL_WORKER_AT_STEP`).

When a worker process dies, its whole worker group goes with it: everything the workers held in
memory, and every metric reported since the last checkpoint. `RunLog` is a small Ray actor that the
notebook creates and owns, so it outlives the worker group: rank 0 tells it each step's loss and
each attempt's starting step, and it lets exactly one worker die once. Afterwards it can say which
steps ran twice and whether they gave the same losses.
"""

from __future__ import annotations

__all__ = ["RunLog", "run_log", "check_kill_step", "report_collection_seconds"]


class RunLog:
    """Per-step losses of every attempt of one run, kept outside the workers (a Ray actor)."""

    def __init__(self) -> None:
        self.attempts: list[dict] = []  # each: {"resumed_from": step, "losses": {step: loss}}
        self.killed_at: int | None = None
        self._notes: dict = {}

    def note(self, key: str, value) -> None:
        """Keep a small fact of the run (e.g. where the workers ran) for the notebook to read."""
        self._notes[key] = value

    def notes(self) -> dict:
        return dict(self._notes)

    def start_attempt(self, resumed_from_step: int) -> int:
        self.attempts.append({"resumed_from": int(resumed_from_step), "losses": {}})
        return len(self.attempts)

    def log(self, step: int, loss: float) -> None:
        self.attempts[-1]["losses"][int(step)] = float(loss)

    def claim_kill(self, step: int) -> bool:
        """True for the first caller only: the kill happens once per run, not again after the restart."""
        if self.killed_at is not None:
            return False
        self.killed_at = int(step)
        return True

    def losses(self) -> list[float]:
        """The run's losses by step; a step run twice counts with its last attempt's value."""
        merged: dict[int, float] = {}
        for attempt in self.attempts:
            merged.update(attempt["losses"])
        return [merged[s] for s in sorted(merged)]

    def attempt_losses(self) -> list[dict]:
        return [
            {"resumed_from": a["resumed_from"], "losses": {str(k): v for k, v in a["losses"].items()}}
            for a in self.attempts
        ]

    def kill_summary(self) -> dict | None:
        """`{"at_step", "resumed_from_step", "restarts", "replayed_steps", "replayed_max_abs_diff"}`."""
        if self.killed_at is None:
            return None
        first, last = self.attempts[0]["losses"], self.attempts[-1]["losses"]
        replayed = sorted(set(first) & set(last)) if len(self.attempts) > 1 else []
        return {
            "at_step": self.killed_at,
            "resumed_from_step": self.attempts[-1]["resumed_from"],
            "restarts": len(self.attempts) - 1,
            "replayed_steps": replayed,
            "replayed_max_abs_diff": max((abs(first[s] - last[s]) for s in replayed), default=None),
        }


def run_log():
    """Create the notebook's `RunLog` actor (no CPU reserved: it only stores a few numbers)."""
    import ray

    return ray.remote(num_cpus=0)(RunLog).remote()


def check_kill_step(name: str, value, num_workers: int, total_steps: int | None = None) -> int:
    """`KILL_WORKER_AT_STEP`: 0 (off) or a step of the run (when `total_steps` is known), with a rank 1 to kill."""
    from .validate import ParameterError, check_int

    check_int(name, value, minimum=0)
    if value and num_workers < 2:
        raise ParameterError(f"{name}={value}: kills the rank-1 worker, so it needs NUM_WORKERS >= 2.")
    if total_steps is not None and value > total_steps:
        raise ParameterError(
            f"{name}={value}: the run has only {total_steps} steps; use 0 (off) or 1..{total_steps}."
        )
    return value


def report_collection_seconds() -> float:
    """Two of Ray Train's report-collection intervals, in seconds: how long a worker that is about to be
    killed waits first (GPT-2 and GLUE notebooks, "A worker that dies").

    Ray Train's controller collects the workers' reports when it polls them, every
    `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (2 s by default; the laptop's Ray uses 0.5 s). A worker that
    dies sooner after a checkpoint's report can take that checkpoint with it, and the run then resumes
    from the one before: seen with GLUE's 30 ms steps, and with GPT-2's (0.1 s) once in a dozen runs.
    """
    import os

    return 2 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2"))
