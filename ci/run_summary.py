"""The summaries of a `make run` folder: summary.json, summary.md and summary.html.

The input is what ci/run_notebooks.py measured (one row per notebook: status, wall seconds, error) and
the results JSON each notebook wrote. summary.html is one self-contained page (no script, no CDN; the
loss curves are PNGs drawn with matplotlib's Agg backend and embedded as data URIs): an overview table,
then one section per notebook with the numbers its lesson is about. Every figure is optional: a failed
notebook writes no results, and a notebook that changes its results keys loses only that line.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

Fact = tuple[str, str]  # label, HTML


def final_number(results: dict) -> str:
    """The number a reader looks for first: the final metric if there is one, else the last loss."""
    metrics = results.get("metrics") or {}  # the kept checkpoint's (eval_metrics: the metric per step)
    if metrics:
        return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
    return f"loss {results['losses'][-1]:.4f}" if results.get("losses") else "-"


def load_results(path: Path) -> dict:
    """The results a notebook wrote, or {} where it wrote none (or something that is not a JSON object)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return results if isinstance(results, dict) else {}


def write_summaries(run_dir: Path, rows: list[dict], title: str = "") -> str:
    """Write summary.json, summary.md and summary.html into `run_dir`; return the Markdown table."""
    (run_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    lines = ["| notebook | status | wall (s) | final loss / metric |", "|---|---|---|---|"]
    lines += [f"| {r['notebook']} | {r['status']} | {r['wall_seconds']} | {r['final']} |" for r in rows]
    lines += [""] + [f"- {r['notebook']}: {r['error']}" for r in rows if r["status"] != "ok"]
    markdown = "\n".join(lines).rstrip() + "\n"
    (run_dir / "summary.md").write_text(markdown)
    results = {r["notebook"]: load_results(run_dir / f"{r['notebook']}.json") for r in rows}
    (run_dir / "summary.html").write_text(render_html(rows, results, title or run_dir.name))
    return markdown


# ---------------------------------------------------------------------------------------------- numbers


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bytes(n) -> str:
    n = _num(n)
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # unreachable


def _pct(fractions: Iterable) -> str:
    return " / ".join(f"{f:.1%}" for f in fractions if _num(f) is not None)


def _share(need: float | None, have: float | None) -> str:
    if need is None or not have:
        return ""
    share = need / have
    return f"{share:.0%}" if share >= 0.01 or share == 0 else f"{share:.2%}"


def _e(value) -> str:
    return html.escape(str(value))


def _steps(steps: list) -> str:
    """[13, 14, 15] -> '13-15'; a list with gaps as it is."""
    ints = [s for s in steps if isinstance(s, int)]
    if len(ints) > 2 and ints == list(range(ints[0], ints[-1] + 1)):
        return f"{ints[0]}-{ints[-1]}"
    return ", ".join(str(s) for s in steps)


def _losses(results: dict) -> list[float]:
    return [float(x) for x in results.get("losses") or [] if _num(x) is not None]


def _fact_loss(r: dict) -> Iterable[Fact]:
    losses = _losses(r)
    final = _num(r.get("final_loss"))
    if final is None and losses:
        final = losses[-1]
    if final is not None:
        span = f"{losses[0]:.4f} &rarr; " if losses else ""
        yield (
            "Training loss",
            f"{span}<b>{final:.4f}</b>"
            + (f" <span class=dim>({len(losses)} logged steps)</span>" if losses else ""),
        )


def _fact_eval(r: dict) -> Iterable[Fact]:
    metrics = r.get("metrics")
    if isinstance(metrics, dict) and metrics:
        where = ", ".join(_e(r[k]) for k in ("task", "eval_split") if r.get(k))
        shown = ", ".join(f"{_e(k)} <b>{v:.4f}</b>" for k, v in metrics.items() if _num(v) is not None) or _e(
            metrics
        )
        yield "Eval metric" + (f" ({where})" if where else ""), shown


def _fact_sharding(r: dict) -> Iterable[Fact]:
    if isinstance(r.get("param_shard_fraction"), list):
        yield "Parameters held per worker", f"<b>{_pct(r['param_shard_fraction'])}</b>"
    if "zero_stage" in r or isinstance(r.get("partition_fraction"), list):
        stage = f"ZeRO stage {_e(r['zero_stage'])}" if "zero_stage" in r else "ZeRO"
        offload = f", offload {_e(r['offload'])}" if r.get("offload") else ""
        held = (
            f": <b>{_pct(r['partition_fraction'])}</b> of the partitioned state per worker"
            if isinstance(r.get("partition_fraction"), list)
            else ""
        )
        yield "DeepSpeed", f"{stage}{offload}{held}"
    if isinstance(r.get("param_dtypes"), list):
        yield "Trained parameters' dtype", _e(", ".join(map(str, r["param_dtypes"])))
    states = r.get("state_bytes")
    if isinstance(states, list) and states and all(isinstance(s, dict) for s in states):
        per = "; ".join(
            f"rank {i}: {_bytes(s.get('param_bytes'))} params + {_bytes(s.get('optimizer_bytes'))} optimizer"
            for i, s in enumerate(states)
        )
        yield "State held per worker", per


def _fact_memory(r: dict) -> Iterable[Fact]:
    rss = r.get("load_peak_rss_mb")
    if isinstance(rss, list) and rss:
        yield (
            "Peak RSS while loading",
            ", ".join(f"rank {i} <b>{v:,.1f} MB</b>" for i, v in enumerate(rss) if _num(v) is not None),
        )
    plan = r.get("plan")
    rows = plan.get("rows") if isinstance(plan, dict) else None
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        first = rows[0]
        need, have = _num(first.get("need")), _num(first.get("have"))
        share = f" ({_share(need, have)})" if _share(need, have) else ""
        verdict = _e(first.get("status") or "-")
        yield (
            f"Will it fit? ({_e(first.get('where', ''))})",
            f"<span class='verdict {_e(first.get('status', ''))}'>{verdict}</span>: needs {_bytes(need)}"
            + (f" of {_bytes(have)}{share}" if have else ""),
        )


def _fact_speed(r: dict) -> Iterable[Fact]:
    tps = _num(r.get("tokens_per_second"))
    if tps is not None:
        yield "Throughput", f"<b>{tps:,.0f}</b> tokens/s"
    if "mfu" in r:
        mfu = _num(r["mfu"])
        yield "MFU", f"<b>{mfu:.2%}</b>" if mfu is not None else "not available on CPU"
    seconds = _num(r.get("train_seconds"))
    if seconds is not None:
        yield "Training time", f"{seconds:.0f} s"
    cost = _num(r.get("cost_usd"))
    if cost is not None:
        yield "Cost at the tutorial's instance prices", f"<b>${cost:.2f}</b>"


def _kill(results: dict):
    """The planned kill: the run's own, or that of the "When a worker dies" section's run (`worker_dies`)."""
    demo = results.get("worker_dies")
    return results.get("kill") or (demo.get("kill") if isinstance(demo, dict) else None)


def _fact_resume(r: dict) -> Iterable[Fact]:
    kill = _kill(r)
    if isinstance(kill, dict) and kill:
        parts = []
        if "at_step" in kill:
            parts.append(f"worker killed at step <b>{_e(kill['at_step'])}</b>")
        if "resumed_from_step" in kill:
            parts.append(f"resumed from step <b>{_e(kill['resumed_from_step'])}</b>")
        if "restarts" in kill:
            parts.append(f"{_e(kill['restarts'])} restart(s)")
        if kill.get("replayed_steps"):
            parts.append(f"steps {_e(_steps(kill['replayed_steps']))} run twice")
        diff = _num(kill.get("replayed_max_abs_diff"))
        if diff is not None:
            parts.append(f"max |loss diff| <b>{diff:.2g}</b>")
        yield "Killed worker", "; ".join(parts) or _e(kill)
    elif _num(r.get("resumed_from_step")) is not None:
        yield "Resumed from step", _e(r["resumed_from_step"])
    replayed = r.get("replayed_losses")
    if isinstance(replayed, dict) and replayed:
        yield (
            "Replayed losses",
            "<br>".join(
                f"{_e(k)}: " + ", ".join(f"{x:.4f}" for x in v if _num(x) is not None)
                for k, v in replayed.items()
                if isinstance(v, list)
            ),
        )
    resumed = [float(x) for x in r.get("resumed_losses") or [] if _num(x) is not None]
    if "resumed_start_epoch" in r or resumed:
        epoch = f"at epoch {_e(r['resumed_start_epoch'])}" if "resumed_start_epoch" in r else ""
        curve = (
            f": loss {resumed[0]:.4f} &rarr; {resumed[-1]:.4f} over {len(resumed)} steps" if resumed else ""
        )
        yield "Resumed from the final checkpoint", (epoch + curve) or "yes"


def _fact_cluster(r: dict) -> Iterable[Fact]:
    nodes = r.get("worker_node_ids")
    if isinstance(nodes, list) and nodes:
        distinct = sorted({str(n)[:8] for n in nodes})
        yield (
            "Ray nodes of the workers",
            f"{len(distinct)} <span class=dim>({_e(', '.join(distinct))})</span>",
        )
    if r.get("attn_implementation"):
        yield "Attention", _e(r["attn_implementation"])
    if r.get("checkpoint_path"):
        yield "Checkpoint", f"<code>{_e(r['checkpoint_path'])}</code>"
    if r.get("mlflow_run_id"):
        where = r.get("mlflow") or {}
        run = f"<code>{_e(r['mlflow_run_id'])}</code>"
        if where.get("run_url"):
            run = f"<a href='{_e(where['run_url'])}'>{run}</a>"
        yield "MLflow run", f"{run} <span class=dim>in {_e(where.get('tracking_uri', ''))}</span>"


FACTS: list[Callable[[dict], Iterable[Fact]]] = [
    _fact_loss,
    _fact_eval,
    _fact_sharding,
    _fact_memory,
    _fact_speed,
    _fact_resume,
    _fact_cluster,
]


def facts(results: dict) -> list[Fact]:
    """The numbers of one notebook's results, as (label, HTML) pairs; a key that is missing or has an
    unexpected shape leaves out its line, never the page."""
    out: list[Fact] = []
    for fact in FACTS:
        try:
            out.extend(fact(results))
        except Exception:  # noqa: BLE001 - a results file from another version of a notebook
            continue
    return out


def headline(results: dict) -> str:
    """One short cell for the overview table: the resume story."""
    kill = _kill(results)
    if isinstance(kill, dict) and "at_step" in kill:
        text = f"killed at {kill['at_step']}"
        if "resumed_from_step" in kill:
            text += f", resumed from {kill['resumed_from_step']}"
        diff = _num(kill.get("replayed_max_abs_diff"))
        if diff is not None:
            text += f", replay diff {diff:.2g}"
        return text
    return "-"


# ---------------------------------------------------------------------------------------------- chart


def _attempt_curves(results: dict) -> list[tuple[int | None, list[tuple[int, float]]]]:
    """Each attempt's (resumed_from, [(step, loss)]), from the results' `attempts`, sorted by step."""
    curves = []
    for attempt in results.get("attempts") or []:
        if not isinstance(attempt, dict) or not isinstance(attempt.get("losses"), dict):
            continue
        points = sorted(
            (int(step), float(loss)) for step, loss in attempt["losses"].items() if _num(loss) is not None
        )
        if points:
            curves.append((attempt.get("resumed_from_step"), points))
    return curves


def loss_chart_png(results: dict) -> bytes | None:
    """The loss curve as a PNG (None without losses): `losses` against the step, the first attempt where
    a worker was killed, the kill, and the losses after a resume from the final checkpoint."""
    losses = _losses(results)
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    curves = _attempt_curves(results)
    merged: dict[int, float] = {}
    for _, points in curves:
        merged.update(points)  # a later attempt's step replaces the earlier one
    steps = sorted(merged) if len(merged) == len(losses) else list(range(1, len(losses) + 1))
    x_label = "step" if len(merged) == len(losses) else "logged step"

    fig = Figure(figsize=(6.4, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#1f6feb", lw=1.8, label="loss")
    if len(curves) > 1 and x_label == "step":  # on top: where the resumed run replays it, they coincide
        first = curves[0][1]
        ax.plot(*zip(*first, strict=True), color="#57606a", lw=1.4, ls=(0, (3, 3)), label="first attempt")
    kill = results.get("kill") if isinstance(results.get("kill"), dict) else {}
    if x_label == "step" and _num(kill.get("at_step")) is not None:
        ax.axvline(
            kill["at_step"], color="#d1242f", ls=":", lw=1.2, label=f"worker killed ({kill['at_step']})"
        )
    if x_label == "step" and _num(kill.get("resumed_from_step")) is not None:
        ax.axvline(
            kill["resumed_from_step"],
            color="#2da44e",
            ls=":",
            lw=1.2,
            label=f"resumed from ({kill['resumed_from_step']})",
        )
    resumed = [float(x) for x in results.get("resumed_losses") or [] if _num(x) is not None]
    if resumed:
        start = steps[-1] + 1
        ax.plot(range(start, start + len(resumed)), resumed, color="#8250df", lw=1.8, label="resumed run")
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss")
    if all(v > 0 for v in losses + resumed) and max(losses + resumed) / min(losses + resumed) > 50:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- page

CSS = """
:root { --ok: #1a7f37; --bad: #cf222e; --dim: #57606a; --line: #d0d7de; --bg: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       margin: 0 auto; padding: 24px; max-width: 1200px; overflow-wrap: break-word; }
h1 { font-size: 1.6em; margin: 0 0 4px; } h2 { font-size: 1.3em; margin: 0 0 2px; }
h3 { font-size: 1em; margin: 16px 0 6px; }
.dim, .sub { color: var(--dim); } .sub { margin: 0 0 16px; }
table { border-collapse: collapse; max-width: 100%; }
table.overview { width: 100%; } table.overview td:first-child { white-space: nowrap; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--bg); font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.badge { display: inline-block; padding: 0 8px; border-radius: 10px; color: #fff; font-size: .85em;
         font-weight: 600; vertical-align: middle; white-space: nowrap; }
.badge.ok { background: var(--ok); } .badge.failed { background: var(--bad); }
.verdict.ok { color: var(--ok); font-weight: 600; }
.verdict.close { color: #9a6700; font-weight: 600; } .verdict.too.big { color: var(--bad); font-weight: 600; }
section.nb { border: 1px solid var(--line); border-radius: 8px; padding: 16px 20px; margin: 20px 0; }
section.nb.failed { border-color: var(--bad); }
.grid { display: flex; flex-wrap: wrap; gap: 20px; align-items: flex-start; }
.grid > .facts { flex: 1 1 460px; min-width: 0; }
.grid > figure { flex: 0 1 580px; margin: 0; min-width: 0; }
figure img { display: block; width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; }
figcaption { color: var(--dim); font-size: .85em; }
table.facts th { background: none; width: 36%; font-weight: 500; color: var(--dim); }
pre { background: var(--bg); border: 1px solid var(--line); border-radius: 4px; padding: 8px 10px;
      white-space: pre-wrap; overflow-wrap: anywhere; margin: 4px 0; font-size: .9em; }
pre.error { border-color: var(--bad); color: var(--bad); }
code { font-size: .9em; overflow-wrap: anywhere; }
a { color: #0969da; }
"""


def _plan_table(results: dict) -> str:
    plan = results.get("plan")
    rows = plan.get("rows") if isinstance(plan, dict) else None
    if not isinstance(rows, list) or not rows:
        return ""
    body = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        need, have = _num(row.get("need")), _num(row.get("have"))
        share = _share(need, have)
        status = row.get("status") or ""
        body.append(
            f"<tr><td>{_e(row.get('what', ''))}</td><td>{_e(row.get('where', ''))}</td>"
            f"<td class=num>{_bytes(need)}</td><td class=num>{_bytes(have) if have else ''}</td>"
            f"<td class=num>{share}</td><td><span class='verdict {_e(status)}'>{_e(status)}</span></td></tr>"
        )
    return (
        "<h3>Memory plan (estimated before training)</h3><table class=plan><tr><th>what</th><th>where</th>"
        "<th>needs</th><th>has</th><th>share</th><th>status</th></tr>" + "".join(body) + "</table>"
    )


def _eval_table(results: dict) -> str:
    history = [h for h in results.get("eval_history") or [] if isinstance(h, dict)]
    if not history:
        return ""
    keys = [k for k in history[0] if k.startswith("eval_") and k not in ("eval_runtime",)]
    keys = [k for k in keys if "per_second" not in k]
    head = "".join(f"<th>{_e(k.removeprefix('eval_'))}</th>" for k in keys)
    body = "".join(
        f"<tr><td class=num>{i}</td>"
        + "".join(f"<td class=num>{_fmt(h.get(k))}</td>" for k in keys)
        + "</tr>"
        for i, h in enumerate(history, 1)
    )
    return f"<h3>Evaluations</h3><table class=evals><tr><th>#</th>{head}</tr>{body}</table>"


def _seconds(value) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.0f} s"


def _fmt(value) -> str:
    v = _num(value)
    return "" if v is None else f"{v:.4f}" if not math.isclose(v, round(v)) else f"{v:.0f}"


def _generated(results: dict) -> str:
    texts = results.get("generated")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        return ""
    return "<h3>Generated by the fine-tuned model</h3>" + "".join(f"<pre>{_e(t)}</pre>" for t in texts)


def _section(row: dict, results: dict) -> str:
    name, status = row["notebook"], row.get("status", "failed")
    wall = _num(row.get("wall_seconds"))
    parts = [
        f"<section class='nb {_e(status)}' id='{_e(name)}'>",
        f"<h2>{_e(name)} <span class='badge {_e(status)}'>{_e(status)}</span></h2>",
        "<p class=sub>"
        + (f"{_e(row['title'])} &middot; " if row.get("title") else "")
        + (f"wall time {wall:.0f} s &middot; " if wall is not None else "")
        + ("smoke mode &middot; " if results.get("smoke_test") else "")
        + f"<a href='{_e(name)}.ipynb'>executed notebook</a> &middot; <a href='{_e(name)}.log'>full output</a>"
        + "</p>",
    ]
    if status != "ok":
        parts.append(f"<pre class=error>{_e(row.get('error') or 'failed')}</pre>")
    if not results:
        parts.append("<p class=dim>No results file: the notebook did not get to its last cell.</p>")
    else:
        fact_rows = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in facts(results))
        png = loss_chart_png(results)
        figure = (
            f"<figure><img alt='{_e(name)} loss curve' src='data:image/png;base64,"
            f"{base64.b64encode(png).decode()}'><figcaption>Training loss of {_e(name)}"
            "</figcaption></figure>"
            if png
            else ""
        )
        parts.append(f"<div class=grid><table class=facts>{fact_rows}</table>{figure}</div>")
        parts += [_plan_table(results), _eval_table(results), _generated(results)]
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


def render_html(rows: list[dict], results: dict[str, dict], title: str = "make run") -> str:
    """The summary page: an overview table, then one section per notebook (see the module docstring)."""
    ok = sum(r.get("status") == "ok" for r in rows)
    total = sum(_num(r.get("wall_seconds")) or 0 for r in rows)
    overview = "".join(
        f"<tr><td><a href='#{_e(r['notebook'])}'>{_e(r['notebook'])}</a></td>"
        f"<td><span class='badge {_e(r.get('status', ''))}'>{_e(r.get('status', ''))}</span></td>"
        f"<td class=num>{_seconds(r.get('wall_seconds'))}</td>"
        f"<td>{_e(r.get('final') or final_number(results.get(r['notebook']) or {}))}</td>"
        f"<td>{_e(headline(results.get(r['notebook']) or {}))}</td>"
        f"<td>{_e(r.get('error') or '')}</td></tr>"
        for r in rows
    )
    sections = "\n".join(_section(r, results.get(r["notebook"]) or {}) for r in rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>make run: {_e(title)}</title>
<style>{CSS}</style></head>
<body>
<h1>make run: {_e(title)}</h1>
<p class=sub>{ok} of {len(rows)} notebook(s) ok &middot; {total:.0f} s of notebooks</p>
<table class=overview>
<tr><th>notebook</th><th>status</th><th>wall</th><th>final loss / metric</th><th>killed worker</th>
<th>error</th></tr>
{overview}
</table>
{sections}
</body></html>
"""
