"""The report as one self-contained HTML page: styles and its one small script inline, charts as
inline SVG, no network. Sections, in order: verdicts, metrics, timings, divergence (two runs),
log-prob mismatch, TITO findings, manifest. The script only folds and unfolds long tables."""

from __future__ import annotations

import html
import json

from rlbench.report import svg

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1d2b3a;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
nav a{color:#cde;margin-right:14px;font-size:13px}main{padding:8px 24px 40px}
section{background:#fff;border:1px solid #ddd;border-radius:6px;margin:16px 0;padding:10px 16px}
h2{font-size:16px;margin:6px 0 10px}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}
.grid{display:flex;flex-wrap:wrap;gap:10px}.chart{margin:0}figcaption{font-size:12px;color:#444}
.axis{stroke:#999}.tick{font-size:10px;fill:#666}.mark{stroke:#c0392b;stroke-width:1;stroke-dasharray:3 2}
.band{fill:#2f9e44;opacity:.18}.bar{fill:#1f6fb5}.key{margin-left:8px}.key:before{content:"";display:inline-block;
width:10px;height:3px;background:var(--c);margin-right:4px;vertical-align:middle}
.ok{color:#2f7d32;font-weight:600}.bad{color:#c0392b;font-weight:600}.und{color:#9a6b00;font-weight:600}
.tokens{font-family:ui-monospace,monospace;font-size:12px;display:flex;flex-wrap:wrap;gap:2px}
.tok{border:1px solid #ddd;border-radius:3px;padding:1px 3px;background:#f4f6f8}.tok.diff{background:#fde2dd;
border-color:#c0392b}.tok.prompt{background:#eef}.none{color:#777;font-style:italic}pre{white-space:pre-wrap}
.hidden{display:none}button{font-size:12px}
"""

SCRIPT = """
document.querySelectorAll('button[data-fold]').forEach(function (button) {
  button.addEventListener('click', function () {
    var target = document.getElementById(button.getAttribute('data-fold'));
    target.classList.toggle('hidden');
    button.textContent = target.classList.contains('hidden') ? 'show' : 'hide';
  });
});
"""

VERDICT_CLASS = {
    "no difference": "ok",
    "no drift": "ok",
    "passed": "ok",
    "measured": "ok",
    "differ": "bad",
    "drift": "bad",
    "failed": "bad",
    "undetermined": "und",
}


def e(value) -> str:
    return html.escape(str(value))


def render(data: dict) -> str:
    """The whole page."""
    runs = data["runs"]
    title = "rlbench report: " + " vs ".join(r["path"] for r in runs)
    sections = [_verdicts(data), _metrics(data), _timings(data)]
    if len(runs) > 1:
        sections.append(_divergence(data))
    sections += [_mismatch(data), _tito(data), _manifest(data)]
    nav = "".join(
        f'<a href="#{sid}">{e(name)}</a>'
        for sid, name in [("verdicts", "verdicts"), ("metrics", "metrics"), ("timings", "timings")]
        + ([("divergence", "divergence")] if len(runs) > 1 else [])
        + [("mismatch", "log-prob mismatch"), ("tito", "TITO"), ("manifest", "manifest")]
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{STYLE}</style></head><body><header><h1>{e(title)}</h1><nav>{nav}</nav></header>"
        f"<main>{''.join(sections)}</main><script>{SCRIPT}</script></body></html>\n"
    )


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{e(title)}</h2>{body}</section>'


def _verdicts(data: dict) -> str:
    rows = "".join(
        f'<tr><td>{e(v["check"])}</td><td class="{VERDICT_CLASS.get(v["verdict"], "")}">'
        f"{e(v['verdict'])}</td><td>{e(v['detail'])}</td></tr>"
        for v in data["verdicts"]
    )
    runs = "".join(
        f"<tr><td>{'AB'[i]}</td><td>{e(r['path'])}</td><td>{r['steps']} committed steps</td>"
        f"<td>{e('; '.join(r['notes']))}</td></tr>"
        for i, r in enumerate(data["runs"])
    )
    return _section(
        "verdicts",
        "Verdicts",
        f"<table>{runs}</table><table><tr><th>check</th><th>verdict</th><th>what it compared</th></tr>{rows}</table>",
    )


def _marks(data: dict, name: str) -> list[int]:
    marks = [data["divergence"]["step"]] if data.get("divergence") else []
    golden = (data.get("golden") or {}).get("metrics", {}).get(name)
    return marks + (golden["failing"] if golden else [])


def _metrics(data: dict) -> str:
    charts = []
    golden = (data.get("golden") or {}).get("metrics", {})
    for name, sides in data["metrics"].items():
        series = [("A", sides["a"], "")] + ([("B", sides["b"], "5 3")] if sides["b"] else [])
        if name in golden:
            series.append(("golden", golden[name]["expected"], "2 2"))
        charts.append(svg.line_chart(name, series, _marks(data, name), golden.get(name, {}).get("band", [])))
    note = "Red dashed lines: the first divergence" + (" and the golden's failing steps" if golden else "") + "."
    return _section("metrics", "Metrics", f'<p>{e(note)}</p><div class="grid">{"".join(charts)}</div>')


def _timings(data: dict) -> str:
    charts = []
    for name, sides in data["timings"].items():
        series = [("A", sides["a"], "")] + ([("B", sides["b"], "5 3")] if sides["b"] else [])
        charts.append(svg.line_chart(f"{name} (s)", series))
    body = f'<div class="grid">{"".join(charts)}</div>' if charts else '<p class="none">no timings recorded</p>'
    return _section("timings", "Per-stage timings per step", body)


def _tokens(side: dict, differ: set[int]) -> str:
    cells = []
    for i, (token, text) in enumerate(zip(side["ids"], side["text"])):
        kind = "diff" if i in differ else "prompt" if i < side["prompt"] else ""
        cells.append(
            f'<span class="tok {kind}" title="position {i}, log-prob {side["logprobs"][i]:.6g}">'
            f"{token}<br>{e(repr(text)[1:-1])}</span>"
        )
    return f'<div class="tokens">{"".join(cells)}</div>'


def _divergence(data: dict) -> str:
    first = data.get("divergence")
    if first is None:
        return _section(
            "divergence",
            "Where the runs part",
            '<p class="ok">No difference: every checksum of every '
            "committed step agrees (the verdicts say how many were compared).</p>",
        )
    body = (
        f"<p>First divergence at <b>step {first['step']}</b>, stage <b>{e(first['stage'])}</b>: {e(first['where'])}</p>"
    )
    sample = first.get("sample")
    if sample:
        differ = set(sample["differ"])
        body += (
            f"<p>Sample {sample['index']} of step {first['step']}: {len(differ)} positions differ "
            f"(highlighted; the prompt is shaded; hover a token for its log-prob).</p>"
            f"<h3>A</h3>{_tokens(sample['a'], differ)}<h3>B</h3>{_tokens(sample['b'], differ)}"
        )
    return _section("divergence", "Where the runs part", body)


def _mismatch(data: dict) -> str:
    m = data["mismatch"]
    if not m["tokens"]:
        return _section(
            "mismatch",
            "Train-inference log-prob mismatch",
            '<p class="und">Undetermined: the recording holds no trainer log-probs.</p>',
        )
    stats = ", ".join(f"{k} {v:.3g}" for k, v in m["stats"].items())
    rows = "".join(
        f"<tr><td>{w['step']}</td><td>{w['sample']}</td><td>{w['token']}</td><td>{w['id']}</td>"
        f"<td><code>{e(w['text'])}</code></td><td><code>{e(w['context'])}</code></td>"
        f"<td>{w['trainer']:.6g}</td><td>{w['rollout']:.6g}</td><td>{w['delta']:.3g}</td></tr>"
        for w in m["worst"]
    )
    table = (
        "<table><tr><th>step</th><th>sample</th><th>response token</th><th>id</th><th>text</th>"
        f"<th>context</th><th>trainer</th><th>rollout</th><th>delta</th></tr>{rows}</table>"
    )
    span = f"{m['steps']} steps" if m["steps"] == m["of"] else f"{m['steps']} of {m['of']} steps, evenly spread"
    lags = "".join(
        f"<tr><td>{r['lag']}</td><td>{r['samples']}</td><td>{r['tokens']}</td>"
        f"<td>{r['train_rollout_logprob_abs_diff']:.4g}</td><td>{r['token_mean_abs']:.4g}</td><td>{r['max_abs']:.4g}</td></tr>"
        for r in m.get("per_lag") or []
    )
    body = (
        f"<p>{m['tokens']} judged tokens of {e(span)}; {e(stats)}</p>"
        + svg.histogram("|trainer - rollout| log-prob per token (log-scale counts)", m["counts"], m["labels"])
        + (
            "<h3>By policy lag (weight versions between a sample's generation and its training)</h3><table><tr>"
            "<th>lag</th><th>samples</th><th>tokens</th><th>train_rollout_logprob_abs_diff</th>"
            f"<th>token mean</th><th>max</th></tr>{lags}</table>"
            if lags
            else ""
        )
        + f'<h3>Worst tokens <button data-fold="worst">hide</button></h3><div id="worst">{table}</div>'
    )
    return _section("mismatch", "Train-inference log-prob mismatch", body)


def _ids(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def _tito(data: dict) -> str:
    t = data["tito"]
    if not t["ran"]:
        return _section("tito", "TITO findings", '<p class="und">Undetermined on this page: see the verdicts.</p>')
    if not t["findings"]:
        body = f'<p class="ok">No finding: {t["compared"]} of {t["samples"]} samples held to the engine\'s ids.</p>'
    else:
        rows = "".join(
            f"<tr><td>{f['step']}</td><td>{f['sample']}</td><td>{e(f['mode'])}</td><td>{e(f['where'])}</td>"
            f"<td>{f['index']}</td><td><code>{e(f['context'])}</code></td>"
            f"<td><code>{_ids(f['expected'])}</code><br>{e(f['expected_text'])}</td>"
            f"<td><code>{_ids(f['got'])}</code><br>{e(f['got_text'])}</td></tr>"
            for f in t["findings"]
        )
        body = (
            "<table><tr><th>step</th><th>sample</th><th>mode</th><th>where</th><th>first differing id</th>"
            "<th>agreed context</th><th>expected ids / text</th><th>got ids / text</th></tr>" + rows + "</table>"
        )
    notes = "".join(f"<li>{e(n)}</li>" for n in t.get("notes", []))
    return _section("tito", "TITO findings", body + (f"<ul>{notes}</ul>" if notes else ""))


def _manifest(data: dict) -> str:
    blocks = []
    for i, run in enumerate(data["runs"]):
        text = json.dumps(run["manifest"], indent=1, sort_keys=True, default=str)
        blocks.append(
            f'<h3>{"AB"[i]}: {e(run["path"])} <button data-fold="manifest-{i}">hide</button></h3>'
            f'<pre id="manifest-{i}">{e(text)}</pre>'
        )
    return _section("manifest", "Manifest", "".join(blocks))
