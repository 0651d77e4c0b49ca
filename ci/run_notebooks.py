"""`make run`: execute every notebook in notebooks/ in smoke mode with papermill, then summarise.

Writes runs/<timestamp>/ with each executed notebook, its results JSON, and summary.md /
summary.json (per notebook: ok or failed, wall seconds, final loss or metric). Prints the folder.
Smoke mode needs no network, so the Hugging Face libraries are told to stay offline.

`--cluster` (`make run CLUSTER=1`): start the local cluster first (ci/local_cluster.py: two Ray nodes,
an S3 bucket), run every notebook on it with `STORAGE_PATH` in the bucket, and stop it at the end,
also when a notebook fails or the run is interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import papermill

ROOT = Path(__file__).resolve().parents[1]


def final_number(results: dict) -> str:
    """The number a reader looks for first: the final metric if there is one, else the last loss."""
    metrics = results.get("eval_metrics") or {}
    if metrics:
        return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
    return f"loss {results['losses'][-1]:.4f}" if results.get("losses") else "-"


def main() -> int:
    if "--cluster" in sys.argv[1:]:
        sys.path.insert(0, str(ROOT / "ci"))
        import local_cluster

        state, env_file = ROOT / ".cluster-run", ROOT / ".cluster-run" / "cluster.env"
        local_cluster.down(state, env_file, quiet=True)  # left over from an interrupted run
        start = time.perf_counter()
        driver = local_cluster.up(state, env_file)
        print(
            f"Cluster up in {time.perf_counter() - start:.0f} s: 2 Ray nodes, bucket {driver['STORAGE_PATH']}"
        )
        os.environ.update(driver)
        try:
            return run(tag="cluster")
        finally:
            local_cluster.down(state, env_file)
    return run()


def run(tag: str = "") -> int:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MPLBACKEND", "Agg")
    run_dir = ROOT / "runs" / (time.strftime("%Y%m%d-%H%M%S") + (f"-{tag}" if tag else ""))
    run_dir.mkdir(parents=True)
    rows = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        name = notebook.stem
        results_path = run_dir / f"{name}.json"
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        status, error = "ok", ""
        try:
            papermill.execute_notebook(
                str(notebook),
                str(run_dir / f"{name}.ipynb"),
                parameters={"SMOKE_TEST": True, "RESULTS_PATH": str(results_path)},
                kernel_name="python3",
                cwd=str(notebook.parent),
                progress_bar=False,
            )
        except Exception as exc:  # noqa: BLE001 - recorded in the summary, the run goes on
            status, error = "failed", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        wall = time.perf_counter() - start
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        if status == "ok" and not results:
            status, error = "failed", "no results file written"
        rows.append(
            {
                "notebook": name,
                "status": status,
                "wall_seconds": round(wall, 1),
                "final": final_number(results) if results else "-",
                "error": error,
            }
        )
        print(f"   {status} in {wall:.0f} s  {rows[-1]['final']}  {error}", flush=True)

    (run_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    lines = ["| notebook | status | wall (s) | final loss / metric |", "|---|---|---|---|"]
    lines += [f"| {r['notebook']} | {r['status']} | {r['wall_seconds']} | {r['final']} |" for r in rows]
    failed = [r for r in rows if r["status"] != "ok"]
    lines += [""] + [f"- {r['notebook']}: {r['error']}" for r in failed]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nRun folder: {run_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
