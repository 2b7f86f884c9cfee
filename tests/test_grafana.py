"""packaging/grafana/gpupool.json: an importable Grafana dashboard that queries only what gpupoold's
/metrics exports.

- the dashboard's structure: what Grafana's import and file provisioning need (a `datasource`
  template variable rather than an import-only `${DS_PROMETHEUS}` input, `__requires` naming
  the Grafana the README names), unique panel ids, a grid position for every panel, an expr and the input
  datasource for every query, the template variables and rows the contract names;
- every metric name in every query is one docs/metrics.md lists (its tables parsed here),
  histograms only through `_bucket/_sum/_count`, labels and label values as listed;
- every query parses as PromQL (`promtool check rules`);
- a live scrape of a test daemon exports every metric family the dashboard uses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from conftest import GpupoolServer, require

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "packaging" / "grafana" / "gpupool.json"
REFERENCE = REPO / "docs" / "metrics.md"  # every metric name, type and label
DS_INPUT = "${datasource}"  # the data-source template variable: works imported and provisioned
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds to every scraped series (job, instance) or that a histogram's buckets have.
SCRAPE_LABELS = {"job", "instance"}
GRID_WIDTH = 24

METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:$])gpupool_[A-Za-z0-9_]*")
STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
SELECTOR_RE = re.compile(r"(gpupool_[A-Za-z0-9_]*)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LEGEND_RE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
LABEL_VALUES_RE = re.compile(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


# ---------------------------------------------------------------------- the metrics reference
class Metric:
    def __init__(self, name: str, kind: str, labels: set[str], values: dict[str, set[str]]):
        self.name = name
        self.kind = kind  # gauge, counter or histogram
        self.labels = labels
        self.values = values  # label -> its listed values, for labels with a closed list


def _labels(cell: str) -> tuple[set[str], dict[str, set[str]]]:
    """A labels cell of docs/metrics.md -> (label names, the closed value lists):
    "`uuid`, `name` (`a`/`b`)", "`state`: `free`, `leased`", "`interface`: `remoting`; `reason`"."""
    names: set[str] = set()
    values: dict[str, set[str]] = {}
    for part in cell.split(";"):
        listed = re.match(r"\s*`([a-z_][a-z0-9_]*)`:\s*(.*)", part)
        if listed:
            names.add(listed.group(1))
            values[listed.group(1)] = set(re.findall(r"`([^`]+)`", listed.group(2)))
            continue
        for name in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", part)):
            assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), f"unparsable label {name!r} in {cell!r}"
            names.add(name)
    return names, values


def contract_metrics() -> dict[str, Metric]:
    """docs/metrics.md's tables, from "## Per GPU" to the example queries: each row's name, type
    and labels; the rows under "Per GPU" also have the label `gpu` (the section says so)."""
    text = REFERENCE.read_text()
    start = text.index("\n## Per GPU")
    metrics: dict[str, Metric] = {}
    header: list[str] = []
    section = ""
    for line in text[start:text.index("\n## Example queries", start)].splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):
            continue
        if not header:
            header = [c.lower() for c in cells]
            continue
        row = dict(zip(header, cells))
        kind = row["type"].split()[0]
        assert kind in ("gauge", "counter", "histogram"), f"unknown type in row {line!r}"
        labels, values = _labels(row.get("labels", ""))
        if section == "Per GPU":
            labels.add("gpu")
        (name,) = re.findall(r"`(gpupool_[a-z0-9_]+)`", row["name"])
        metrics[name] = Metric(name, kind, labels, values)
    return metrics


def test_contract_parsing() -> None:
    """docs/metrics.md's tables read as this test reads them (a parse that finds nothing would
    let every dashboard through)."""
    metrics = contract_metrics()
    assert len(metrics) >= 35, sorted(metrics)
    assert metrics["gpupool_gpu_memory_total_bytes"].kind == "gauge"
    assert metrics["gpupool_gpu_remapped_rows_failure"].labels == {"gpu"}
    assert metrics["gpupool_gpu_power_limit_watts"].kind == "gauge"
    assert metrics["gpupool_call_duration_seconds"].kind == "histogram"
    assert metrics["gpupool_gpu_state"].values["state"] == {
        "free", "leased", "scrubbing", "quarantined", "drained"}
    assert metrics["gpupool_auth_failures_total"].labels == {"interface", "reason"}
    assert metrics["gpupool_auth_failures_total"].values == {"interface": {"remoting", "http"}}
    assert metrics["gpupool_lease_ends_total"].labels == {"reason"}
    assert metrics["gpupool_gpu_seconds_total"].labels == {"token"}
    assert metrics["gpupool_queue_wait_seconds"].labels == set()
    assert metrics["gpupool_gpu_info"].labels == {"gpu", "uuid", "name", "pci_bus_id", "simulated"}


# ------------------------------------------------------------------------------ the dashboard
def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend format) of every panel target and template variable query."""
    out = []
    for panel in all_panels(dash):
        for target in panel.get("targets", []):
            out.append((f"panel {panel.get('id')} {panel.get('title')!r} target "
                        f"{target.get('refId')}", target.get("expr", ""),
                        target.get("legendFormat", "")))
    for var in dash["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", query, ""))
    return out


def metric_names(expr: str) -> set[str]:
    """The gpupool_ names an expression uses (not inside label-value strings)."""
    return set(METRIC_RE.findall(STRING_RE.sub('""', expr)))


def test_dashboard_structure() -> None:
    dash = load_dashboard()
    for key in ("__requires", "title", "uid", "schemaVersion", "panels", "templating",
                "time", "annotations"):
        assert key in dash, f"dashboard lacks top-level {key!r}"
    assert dash.get("id") is None, "an exported dashboard has id null (Grafana assigns one)"
    assert isinstance(dash["schemaVersion"], int) and 36 <= dash["schemaVersion"] <= 41
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]), dash["uid"]

    # File provisioning does not replace `__inputs` placeholders: the data source is a variable
    # (the default Prometheus when provisioned, a choice on import), the first of them.
    assert "__inputs" not in dash and "DS_PROMETHEUS" not in json.dumps(dash)
    first = dash["templating"]["list"][0]
    assert (first["name"], first["type"], first["query"]) == ("datasource", "datasource",
                                                               "prometheus"), first
    # One Grafana version everywhere: the one __requires names is the one the README names.
    (grafana,) = [r for r in dash["__requires"] if r["type"] == "grafana"]
    readme = (REPO / "packaging" / "grafana" / "README.md").read_text()
    assert re.search(rf"Grafana {re.escape(grafana['version'])} or later", readme), \
        grafana["version"]
    requires = {(r["type"], r["id"]) for r in dash["__requires"]}
    assert ("grafana", "grafana") in requires and ("datasource", "prometheus") in requires
    panels = all_panels(dash)
    for ptype in {p["type"] for p in panels} - {"row"}:
        assert ("panel", ptype) in requires, f"panel type {ptype} not in __requires"

    # Ids unique, every panel placed on the 24-column grid, no two top-level panels overlapping.
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    boxes = []
    for p in panels:
        grid = p.get("gridPos")
        assert isinstance(grid, dict), f"panel {p['id']} has no gridPos"
        assert all(isinstance(grid.get(k), int) for k in "hwxy"), (p["id"], grid)
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= GRID_WIDTH, (p["id"], grid)
    for p in dash["panels"]:
        g = p["gridPos"]
        for q_id, q in boxes:
            overlap = (g["x"] < q["x"] + q["w"] and q["x"] < g["x"] + g["w"]
                       and g["y"] < q["y"] + q["h"] and q["y"] < g["y"] + g["h"])
            assert not overlap, f"panels {q_id} and {p['id']} overlap"
        boxes.append((p["id"], g))

    # Every query panel reads the input datasource; every target has an expr.
    for p in panels:
        if p["type"] == "row":
            continue
        assert p.get("title"), f"panel {p['id']} has no title"
        assert p.get("datasource") == {"type": "prometheus", "uid": DS_INPUT}, (p["id"], p.get(
            "datasource"))
        targets = p.get("targets")
        assert targets, f"panel {p['id']} {p['title']!r} has no targets"
        refs = [t.get("refId") for t in targets]
        assert len(refs) == len(set(refs)) and all(refs), (p["id"], refs)
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), (p["id"], t)
            assert t.get("datasource") == {"type": "prometheus", "uid": DS_INPUT}, (p["id"], t)

    # No datasource but the input (and Grafana's own annotations) anywhere in the file.
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ds = node.get("datasource")
            if isinstance(ds, dict):
                assert ds.get("uid") in (DS_INPUT, "-- Grafana --"), ds
            elif ds is not None:
                assert ds == DS_INPUT, ds
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(dash)


def test_dashboard_variables_and_rows() -> None:
    dash = load_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name in ("job", "instance", "gpu"):
        assert name in variables, f"no {name!r} template variable"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": DS_INPUT}
    gpu_query = {w: e for w, e, _ in queries(dash)}["variable gpu"]
    match = LABEL_VALUES_RE.match(gpu_query)
    assert match and match.group(2) == "gpu", gpu_query
    assert metric_names(match.group(1)) == {"gpupool_gpu_info"}, gpu_query

    rows = [p for p in dash["panels"] if p["type"] == "row"]
    titles = " | ".join(r["title"].lower() for r in rows)
    for wanted in ("pool overview", "leases and queue", "data plane", "scrub", "reset"):
        assert wanted in titles, f"no row titled {wanted!r} (rows: {titles})"
    repeated = [r for r in rows if r.get("repeat") == "gpu"]
    assert len(repeated) == 1, "exactly one row repeats by the gpu variable"
    # The repeated row's panels (up to the next row) select their GPU by $gpu.
    order = dash["panels"]
    start = order.index(repeated[0])
    inside = list(repeated[0].get("panels") or [])
    for p in order[start + 1:]:
        if p["type"] == "row":
            break
        inside.append(p)
    assert len(inside) >= 5, [p["title"] for p in inside]
    for p in inside:
        for t in p["targets"]:
            assert 'gpu="$gpu"' in t["expr"].replace(" ", ""), (p["title"], t["expr"])
    per_gpu = {n for p in inside for t in p["targets"] for n in metric_names(t["expr"])}
    for needed in ("gpupool_gpu_utilization_ratio", "gpupool_gpu_memory_used_bytes",
                   "gpupool_gpu_memory_total_bytes", "gpupool_gpu_temperature_celsius",
                   "gpupool_gpu_power_watts", "gpupool_gpu_state"):
        assert needed in per_gpu, f"the per-GPU row does not show {needed}"
    assert any(p["type"] == "state-timeline" for p in inside), "no state timeline per GPU"

    exprs = " ".join(e for _, e, _ in queries(dash)).replace(" ", "")
    for needed in ("sumby(state)(gpupool_gpu_state",
                   "histogram_quantile(0.5,sumby(le)(rate(gpupool_queue_wait_seconds_bucket",
                   "histogram_quantile(0.95,sumby(le)(rate(gpupool_queue_wait_seconds_bucket",
                   "histogram_quantile(0.5,sumby(le)(rate(gpupool_call_duration_seconds_bucket",
                   "histogram_quantile(0.99,sumby(le)(rate(gpupool_call_duration_seconds_bucket",
                   "sumby(direction)(rate(gpupool_copy_bytes_total",
                   "sumby(class)(rate(gpupool_calls_total"):
        assert needed in exprs, f"no query with {needed}"


def test_the_utilisation_row() -> None:
    """Issue 33, item 4: a Utilisation row with a lease timeline per GPU over
    gpupool_gpu_lease_state whose value mappings name every code the daemon exports
    (http/utilisation.py), leased and busy shares per GPU, and GPU-hours per token."""
    from gpupoold.http import utilisation as u

    dash = load_dashboard()
    order = dash["panels"]
    (row,) = [p for p in order if p["type"] == "row" and p["title"] == "Utilisation"]
    inside = []
    for p in order[order.index(row) + 1:]:
        if p["type"] == "row":
            break
        inside.append(p)
    (timeline,) = [p for p in inside if p["type"] == "state-timeline"]
    assert {n for t in timeline["targets"] for n in metric_names(t["expr"])} == {
        "gpupool_gpu_lease_state"}
    (mapping,) = timeline["fieldConfig"]["defaults"]["mappings"]
    codes = {u.FREE, u.LEASED_IDLE, u.LEASED_BUSY, u.REUSED, u.OUT_OF_SERVICE}
    assert set(mapping["options"]) == {str(c) for c in codes}, mapping
    exprs = " ".join(t["expr"] for p in inside for t in p["targets"]).replace(" ", "")
    for needed in ("sumby(instance,gpu)(rate(gpupool_gpu_leased_seconds_total",
                   "sumby(instance,gpu)(rate(gpupool_gpu_busy_seconds_total",
                   "sumby(token)(increase(gpupool_gpu_seconds_total",
                   "sumby(token)(increase(gpupool_token_busy_seconds_total",
                   "gpupool_gpu_reused_seconds_total"):
        assert needed in exprs, f"the Utilisation row has no query with {needed}"


def test_every_metric_name_is_in_the_contract() -> None:
    """Names, histogram suffixes, labels in selectors/groupings/legends and closed label values
    all as docs/metrics.md lists them."""
    metrics = contract_metrics()
    problems = []
    used: set[str] = set()
    for where, expr, legend in queries(load_dashboard()):
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: no gpupool_ metric in {expr!r}")
        labels_here = set(SCRAPE_LABELS)
        for name in names:
            base = name
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name[:-len(suffix)] in metrics:
                    base = name[:-len(suffix)]
            metric = metrics.get(base)
            if metric is None:
                problems.append(f"{where}: {name} is not in the contract's section 1")
                continue
            if (metric.kind == "histogram") != (base != name):
                problems.append(f"{where}: {name}: a histogram is queried as _bucket/_sum/_count "
                                f"and only a histogram ({base} is a {metric.kind})")
            used.add(base)
            labels_here |= metric.labels | ({"le"} if name.endswith("_bucket") else set())
        for sel_name, body in SELECTOR_RE.findall(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", sel_name)
            metric = metrics.get(sel_name) or metrics.get(base)
            if metric is None:
                continue
            allowed = metric.labels | SCRAPE_LABELS | ({"le"} if sel_name.endswith("_bucket")
                                                       else set())
            for label, op, value in MATCHER_RE.findall(body):
                if label not in allowed:
                    problems.append(f"{where}: {sel_name} has no label {label!r}")
                elif op == "=" and "$" not in value and label in metric.values \
                        and value not in metric.values[label]:
                    problems.append(f"{where}: {sel_name}{{{label}={value!r}}}: the contract "
                                    f"lists {sorted(metric.values[label])}")
        for group in GROUPING_RE.findall(STRING_RE.sub('""', expr)):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in labels_here:
                    problems.append(f"{where}: grouping by {label!r}, a label of none of "
                                    f"{sorted(names)}")
        for label in LEGEND_RE.findall(legend):
            if label not in labels_here:
                problems.append(f"{where}: legend {{{{{label}}}}} names no label of "
                                f"{sorted(names)}")
        match = LABEL_VALUES_RE.match(expr)
        if match and match.group(2) not in labels_here:
            problems.append(f"{where}: label_values of {match.group(2)!r}, not a label of "
                            f"{sorted(names)}")
    assert not problems, "\n".join(problems)
    # The dashboard shows every metric the daemon exports.
    assert not set(metrics) - used, f"metrics no panel shows: {sorted(set(metrics) - used)}"


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool checks every query as a recording rule (Grafana's $variables replaced by values
    of the right kind: a range for $__rate_interval/$__range, a string for the others)."""
    promtool = shutil.which("promtool")
    require(promtool, "promtool not found: install Debian's prometheus package "
                      "(scripts/bootstrap.sh does as root)")
    assert promtool
    lines = ["groups:", "  - name: grafana", "    rules:"]
    for i, (_, expr, _) in enumerate(queries(load_dashboard())):
        if expr.startswith("label_values("):
            match = LABEL_VALUES_RE.match(expr)
            assert match, expr
            expr = match.group(1)
        expr = expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
        expr = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "x", expr)
        lines += [f"      - record: grafana_query_{i}", f"        expr: {json.dumps(expr)}"]
    rules = tmp_path / "rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ live scrape
def scrape(server: GpupoolServer) -> tuple[int, str]:
    req = urllib.request.Request(server.http_url + "/metrics")
    req.add_header("Authorization", f"Bearer {server.token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")


def test_live_scrape_exports_every_dashboard_metric(gpupool_server: GpupoolServer) -> None:
    """A test daemon's /metrics has a family (# TYPE line) for every name the dashboard uses,
    of the contract's type, and the _bucket/_sum/_count samples of every histogram it uses."""
    status, body = scrape(gpupool_server)
    assert status == 200, (f"GET /metrics answered {status}: {body[:500]} (the daemon must "
                           f"export /metrics, docs/metrics.md)")
    types: dict[str, str] = {}
    samples: set[str] = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    metrics = contract_metrics()
    missing = []
    for name in sorted({n for _, e, _ in queries(load_dashboard()) for n in metric_names(e)}):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base != name and metrics.get(base) and metrics[base].kind == "histogram":
            if types.get(base) != "histogram":
                missing.append(f"{base}: no histogram family (# TYPE {base} histogram)")
            elif name not in samples:
                missing.append(f"{name}: the histogram {base} has no {name} sample")
        elif name not in types:
            missing.append(f"{name}: no family (# TYPE {name} ...) in the scrape")
        elif name in metrics and types[name] != metrics[name].kind:
            missing.append(f"{name}: exported as a {types[name]}, the contract says "
                           f"{metrics[name].kind}")
    assert not missing, ("the dashboard queries what /metrics does not export:\n"
                         + "\n".join(missing))


def test_the_provisioning_example_points_where_the_package_installs_the_dashboard() -> None:
    """packaging/grafana/provisioning/gpupool.yaml: a Grafana dashboards provider (apiVersion 1,
    type file) whose path is the folder scripts/build-debs.sh installs gpupool.json into."""
    example = (REPO / "packaging" / "grafana" / "provisioning" / "gpupool.yaml").read_text()
    assert re.search(r"^apiVersion: 1$", example, re.M)
    assert re.search(r"^\s+type: file$", example, re.M)
    path = re.search(r"^\s+path: (\S+)$", example, re.M)
    assert path, example
    build = (REPO / "scripts" / "build-debs.sh").read_text()
    # ship_docs SOURCE=DEST: an absolute DEST is where the package installs that file
    assert f"packaging/grafana/gpupool.json={path.group(1)}/gpupool.json" in build, path.group(1)
