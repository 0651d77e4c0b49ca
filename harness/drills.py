"""The faults of the operating_a_run notebook, played from outside the training code: a worker killed, a spot
notice, a node lost and another one joining.

The training function never kills anything. Each drill runs in the notebook's process while `fit()` trains in
a thread of it (`during`), and acts as the world does: Ray's chaos tests kill a worker from a task on its node
(`ray._private.test_utils`), a cloud sends a spot instance's notice and takes the instance away at the
deadline, an autoscaler adds a node. Where the nodes are the notebook's own (`LaptopCluster`, on a laptop),
a drill stops and starts them; on any other cluster it kills a worker and gives a notice (a drain with a
deadline, Ray's own call), and leaves taking nodes away to the cloud.

What each drill saw is returned as a dict (the steps it acted at) for the notebook's results.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from harness.cluster import LOOPBACK_ONLY

__all__ = [
    "LaptopCluster",
    "during",
    "registered_checkpoints",
    "kill_worker",
    "spot_notice",
    "lose_node",
    "section_costs",
    "DRILL_ENV",
]

DRILL_ENV = {
    # Offline: Ray's usage report (its dashboard's, on the head node started here) goes nowhere.
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    # Ray Train's controller looks at the workers (their reports, their deaths) every 0.5 s and at drains
    # every 1 s (defaults: 2 s and 5 s, for runs of hours), with its preemption watcher on.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1",
    # After a node is lost, Ray Train may first try the old size from a stale view of the cluster: it waits
    # this long for the lost node's room (default 60 s; here a group's room is ready within 1 s), then starts
    # with the workers that fit.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "2",
    # The head's GCS checks each node every second and calls it dead after 3 misses (defaults: 3 s, 5).
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    # No metrics exporters: HTTP servers without a credential, which nothing here reads.
    "RAY_enable_metrics_collection": "0",
}


class LaptopCluster:
    """A Ray cluster on this machine, made of processes this notebook owns (`ray.cluster_utils.Cluster`, as
    Ray's own tests make them): a head node with no CPU for training (the driver, Ray Train's controller and
    the run log live there) and `nodes` worker nodes of `cpus` CPUs each, so that one worker fits per node."""

    def __init__(self, nodes: int = 2, cpus: int = 1, object_store_mb: int = 200) -> None:
        import tempfile

        from ray.cluster_utils import Cluster

        # What shutdown() puts back: this kernel's variables as they were before.
        names = (
            *DRILL_ENV,
            *LOOPBACK_ONLY,
            "RAY_TMPDIR",
            "RAY_ADDRESS",
            "RAY_AUTH_MODE",
            "RAY_AUTH_TOKEN_PATH",
        )
        self._before = {k: os.environ.get(k) for k in names}
        # Its own temp dir (0700): Ray writes the cluster's address there (ray_current_cluster), where a plain
        # `ray.init()` elsewhere on this machine would otherwise find it and attach; and its token.
        self.temp_dir = tempfile.mkdtemp(prefix="ray-laptop-")
        os.environ.update(DRILL_ENV)  # the processes started below inherit them
        os.environ.update(RAY_TMPDIR=self.temp_dir, **self._let_no_one_in())
        self.cpus, self.store = cpus, object_store_mb * 10**6
        # No dashboard: nothing here reads it, and it is one HTTP server fewer (and 2 s) on this machine.
        head = {"num_cpus": 0, "object_store_memory": self.store, "include_dashboard": False}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes = {}
        for _ in range(nodes):
            self.add()
        self.cluster.wait_for_nodes()

    def _let_no_one_in(self) -> dict:
        """Servers that let no one in, as `make cluster-up`'s: token authentication (a new token, in a file
        only this user reads, which this kernel's `ray.init` and every node's processes use), and loopback
        only. For loopback, Ray's own switch (`LOOPBACK_ONLY`, its default on macOS and Windows): the nodes'
        processes get it in their environment; in this kernel, where Ray read it at import, it is set on
        Ray's constants until `shutdown`, so that the nodes started here and `ray.init` keep 127.0.0.1."""
        import ray._private.ray_constants as ray_constants
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )
        from ray._raylet import Config

        token = os.path.join(self.temp_dir, "auth_token")
        with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(generate_new_authentication_token())
        self._cluster_enabled = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        env = {**LOOPBACK_ONLY, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
        os.environ.update(env)
        Config.initialize("")  # this process's Ray reads the token mode again, as Ray's own set-up does
        return env

    @staticmethod
    def needed() -> bool:
        """Whether `ray.init()` would start a Ray of its own here: no `RAY_ADDRESS`, no `ray start` cluster on
        this machine. A drill needs nodes to lose: then this notebook makes them."""
        from harness.cluster import cluster_ray_finds

        return not (os.environ.get("RAY_ADDRESS") or cluster_ray_finds())

    @classmethod
    def where_needed(cls, nodes: int = 2, cpus: int = 1, smoke: bool = False) -> LaptopCluster | None:
        """A new laptop cluster, which `ray.init()` will attach to (`RAY_ADDRESS`), in smoke mode (a laptop:
        the drills need nodes they may stop, not the one-node Ray of `make run` or a cluster of yours) or
        where `needed()`; else None: the cluster that runs is the one to use."""
        if not (smoke or cls.needed()):
            return None
        cluster = cls(nodes, cpus)
        os.environ["RAY_ADDRESS"] = cluster.address
        return cluster

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self) -> str:
        """A new worker node (from the main thread only: Ray installs a signal handler); its id."""
        node = self.cluster.add_node(num_cpus=self.cpus, object_store_memory=self.store)
        self.nodes[node.node_id] = node
        return node.node_id

    def lose(self, node_id: str, notice: bool = False) -> bool:
        """Stop every process of the node `node_id`: after a notice, as the cloud reclaims an instance
        (SIGTERM: Ray records the preemption it announced); without one, as a crash (SIGKILL)."""
        import ray

        node = self.nodes.pop(node_id, None)
        if node is None:
            return False
        self.cluster.remove_node(node, allow_graceful=notice)
        deadline = time.monotonic() + 30  # the GCS's health checks find it dead within about 4 s
        while time.monotonic() < deadline and any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            time.sleep(0.2)
        return True

    def shutdown(self) -> None:
        """Stop this cluster's processes, remove its temp dir, and put the kernel's variables back."""
        import shutil

        import ray._private.ray_constants as ray_constants
        from ray._raylet import Config

        self.cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = self._cluster_enabled
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for name, value in self._before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        Config.initialize("")  # the token mode as it was


def during(fit: Callable, drill: Callable[[], dict]) -> tuple:
    """Run `fit()` in a thread while `drill()` plays the world's part here; return (fit's result, what the
    drill saw). An error in either is raised here, the drill's after fit has ended."""
    out: dict = {}

    def train() -> None:
        try:
            out["result"] = fit()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            out["error"] = exc

    thread = threading.Thread(target=train, name="fit", daemon=True)
    thread.start()
    try:
        seen = drill(lambda: thread.is_alive())
    finally:
        thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"], seen


def _progress(watch) -> dict:
    import ray

    return ray.get(watch.run_log.progress.remote(), timeout=30)


def _wait(watch, training, until: Callable[[dict], bool], poll_s: float = 0.2) -> dict | None:
    """Poll the run log until `until(progress)`; None if the run ended first."""
    while training():
        progress = _progress(watch)
        if until(progress):
            return progress
        time.sleep(poll_s)
    return None


def _head_node() -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])


def _first_attempt_at(watch, training, step: int) -> dict | None:
    """Wait until the run's first attempt has logged `step`, with more than one rank; its progress (None if
    the run ended first)."""
    return _wait(
        watch,
        training,
        lambda now: now["attempts"] == 1 and now["last_step"] >= step and len(now["ranks"]) > 1,
    )


def _worker_node(progress: dict) -> tuple[int, str, int]:
    """(rank, node id, pid) of the last rank not on the head node (rank 1 on two nodes): the one a drill
    takes away (the last rank of all where every worker is on the head). The head keeps the driver, Ray
    Train's controller and the run log."""
    head = _head_node()
    ranks = list(enumerate(progress["ranks"]))
    rank, facts = next(((r, f) for r, f in reversed(ranks) if f["node_id"] != head), ranks[-1])
    return rank, facts["node_id"], facts["pid"]


def _kill_on_node(node_id: str, pid: int) -> None:
    """SIGKILL `pid` on its node: from here where the node is this machine (a `LaptopCluster`'s, whose workers
    are this machine's processes), else from a task on the node, as Ray's `WorkerKillerActor` does. (A task
    first starts a worker process there, a second or more on a busy laptop, while small steps go on: the
    kill would land steps later than the drill chose, past the next checkpoint.)"""
    import signal

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    if address == ray.util.get_node_ip_address() and _is_ray_worker(pid):
        os.kill(pid, signal.SIGKILL)
        return

    @ray.remote(num_cpus=0)
    def kill(pid: int) -> None:
        import signal

        os.kill(pid, signal.SIGKILL)

    ray.get(kill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid))


def _is_ray_worker(pid: int) -> bool:
    """Whether `pid` is a Ray worker process on this machine (Ray names them `ray::...`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def _look_now() -> None:
    """Have Ray Data's autoscaling coordinator, whose reservations size Ray Train's worker groups, look at
    the cluster now rather than at its next 20 s tick (the call Ray makes before it pins work to nodes)."""
    import ray

    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote("drill", recompute=True), timeout=30)
    except Exception:  # noqa: BLE001 - not there (no elastic run yet): nothing to refresh
        pass


def registered_checkpoints(watch):
    """A Ray Train callback for `RunConfig(callbacks=[...])`: Ray Train calls its `after_report` on the run's
    controller once the checkpoint manager has registered a report's checkpoint, and it tells the run log
    that checkpoint's step. A restart resumes from the last registered checkpoint, not from the last one a
    worker wrote (a report still waiting for the controller's next look dies with its worker), so the drills
    act on this."""
    from ray.train import UserCallback

    class RegisteredCheckpoints(UserCallback):
        def __init__(self, run_log) -> None:
            self.run_log = run_log

        def after_report(self, run_context, metrics: list, checkpoint) -> None:
            step = (metrics[0] if metrics else {}).get("step")
            if checkpoint is not None and step is not None:
                self.run_log.registered.remote(int(step))

    return RegisteredCheckpoints(watch.run_log)


def _past_a_registered_checkpoint(now: dict, at_step: int, save_steps: int) -> bool:
    """The first attempt, on more than one rank, has logged `at_step` or later, not a checkpoint's step, and
    the checkpoint before it (one every `save_steps`) is registered: a restart now resumes there."""
    last = now["last_step"]
    saved = last // save_steps * save_steps
    first = now["attempts"] == 1 and len(now["ranks"]) > 1
    return first and last >= at_step and last % save_steps > 0 and now["registered_step"] == saved > 0


def kill_worker(watch, at_step: int, save_steps: int):
    """A drill for `during`: once the first attempt is past `at_step` and a registered checkpoint
    (`_past_a_registered_checkpoint`; the run's `registered_checkpoints` callback), SIGKILL the worker of
    the last rank off the head node (rank 1 on two nodes). Returns {"at_step", "rank"}: the last step logged
    before the kill."""

    def drill(training) -> dict:
        import ray

        progress = _wait(watch, training, lambda now: _past_a_registered_checkpoint(now, at_step, save_steps))
        if progress is None:
            return {}
        rank, node, pid = _worker_node(progress)
        step = progress["last_step"]
        ray.get(watch.run_log.claim_kill.remote(step, f"rank {rank}'s process is killed"))
        _kill_on_node(node, pid)
        return {"at_step": step, "rank": rank}

    return drill


def _drain(node_id: str, deadline_s: float) -> int:
    """A spot notice: Ray's drain of `node_id`, reason PREEMPTION, with a deadline `deadline_s` from now
    (what `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` sends).
    Returns the deadline, in UNIX milliseconds."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int((time.time() + deadline_s) * 1000)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, message = gcs.drain_node(node_id, reason, "a spot notice (operating_a_run)", deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id[:8]}: {message}")
    return deadline_ms


def spot_notice(watch, at_step: int, deadline_s: float, cluster: LaptopCluster | None):
    """A drill for `during`: once the first attempt has logged `at_step`, the node of the first rank off the
    head gets a spot notice (`_drain`). Where the nodes are this notebook's, the fleet's autoscaler starts a
    replacement on the notice (`cluster.add`), and at the deadline the cloud takes the noticed node away
    (`cluster.lose`). Returns {"notice_at_step", "rank", "deadline_s", "last_step_at_reclaim",
    "node_replaced"}."""

    def drill(training) -> dict:
        progress = _first_attempt_at(watch, training, at_step)
        if progress is None:
            return {}
        import ray

        rank, node, _ = _worker_node(progress)
        if node == _head_node():  # never the head: its drain would leave the run nowhere to restart
            print("No worker runs off the head node: no spot notice is sent (a cluster of one node).")
            return {}
        _drain(node, deadline_s)
        deadline_ms = ray._private.state.state.get_draining_nodes().get(node)  # as Ray holds it
        seen = {"notice_at_step": progress["last_step"], "rank": rank, "deadline_s": deadline_s}
        if cluster is not None:
            cluster.add()  # up by the deadline: the restart need not wait for a node
        # Taken away only after the deadline: Ray then records the node's death as the preemption it
        # announced, not a failure (and Ray Train restarts the run at the deadline in any case).
        while training() and deadline_ms and time.time() * 1000 < deadline_ms + 500:
            time.sleep(0.2)
        # The first attempt's last step when the cloud takes the node: held since its just-in-time save.
        progress = _progress(watch)
        seen["last_step_at_reclaim"] = progress["last_step"] if progress["attempts"] == 1 else None
        seen["node_replaced"] = cluster is not None and cluster.lose(node, notice=True)
        return seen

    return drill


def lose_node(watch, after_step: int, save_steps: int, back_after_steps: int, cluster: LaptopCluster | None):
    """A drill for `during` (an elastic run): once the first attempt is past `after_step` and a registered
    checkpoint (one every `save_steps`: `_past_a_registered_checkpoint`), the node of the first rank off the
    head is lost without notice (`cluster.lose`, where the nodes are this notebook's); once a smaller group
    has trained `back_after_steps` steps, a new node joins (`cluster.add`). Returns {"lost_after_step",
    "added_after_step"} (empty where the nodes are not this notebook's)."""

    def drill(training) -> dict:
        if cluster is None:
            return {}
        progress = _wait(
            watch, training, lambda now: _past_a_registered_checkpoint(now, after_step, save_steps)
        )
        if progress is None:
            return {}
        _, node, _ = _worker_node(progress)
        cluster.lose(node)
        _look_now()
        seen = {"lost_after_step": progress["last_step"]}
        start = {}

        def shrunk_and_trained(now: dict) -> bool:
            if now["attempts"] < 2 or (now["world_size"] or 0) >= len(progress["ranks"]):
                return False
            start.setdefault(now["attempts"], now["last_step"])
            return now["last_step"] >= start[now["attempts"]] + back_after_steps

        progress = _wait(watch, training, shrunk_and_trained)
        if progress is not None:
            cluster.add()
            _look_now()
            seen["added_after_step"] = progress["last_step"]
        return seen

    return drill


def section_costs(namespace: dict) -> dict[str, float] | None:
    """Each section's GPU cost at full scale (the notebook's defaults, even in smoke mode), in USD
    (`basics.cost.run_cost`), from the plan's step time at the post's speed: STEPS_PER_SECTION steps, plus
    the steps a section repeats, plus the time its restarts wait (the notice's deadline). None on CPUs."""
    from basics.cost import run_cost
    from harness.sizing import cluster_step_seconds, full_scale

    p = full_scale("operating_a_run", namespace)
    step_s = cluster_step_seconds(p)
    if step_s is None:
        return None
    steps, cluster = p.STEPS_PER_SECTION, p.CLUSTER
    restart_s = 300  # a new worker group, the 7B reloaded from the checkpoint: minutes at full scale
    repeated = p.KILL_WORKER_AT_STEP % p.SAVE_STEPS  # the steps since the last checkpoint
    elastic_step_s = cluster_step_seconds(p, p.MIN_WORKERS) or step_s
    return {
        "a worker dies": run_cost((steps + repeated) * step_s + restart_s, cluster),
        "a spot notice": run_cost(steps * step_s + p.NOTICE_DEADLINE_S + restart_s, cluster),
        # up to half the steps at MIN_WORKERS (the nodes of the others still billed until reclaimed)
        "a node is lost": run_cost(steps / 2 * (step_s + elastic_step_s) + 2 * restart_s, cluster),
    }
