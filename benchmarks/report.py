"""Turning cell records into the outputs: stdout table, JSON, markdown, heatmaps.

The JSON is the record (every timing repetition, every error and traceback, fxfuse's stats
and explain()); the markdown and stdout tables are views of it. Files go to
`<out>/<device-slug>/<benchmark>_<timestamp>.{json,md}` with `<out>` = benchmarks/results by
default, so results of different GPUs never mix.
"""
import json
import math
import re
import sys
import time
from pathlib import Path

from tabulate import tabulate

from .tools import HEADLINE

RESULTS = Path(__file__).parent / "results"
ORDER_TEXT = {"interleaved": "in rounds (one block of each tool per round, order rotated)",
              "sequential": "one after the other"}


def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def fmt_us(us):
    if us is None:
        return "-"
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def fmt_x(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def fmt_err(err):
    return "-" if err is None else f"{err:.1e}"


def ceilings_line(c):
    return (f"matmul {c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({c['matmul_dtype']}, "
            f"{c['matmul_n']}^3), copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
            f"launch {c['launch_s'] * 1e6:.2f} us, eager launch {c['eager_launch_s'] * 1e6:.2f} us"
            + (f", {c['graph_kernel_s'] * 1e6:.2f} us per kernel in a graph"
               if "graph_kernel_s" in c else "")
            + (f", empty module call {c['host_module_call_s'] * 1e6:.2f} us (host)"
               if "host_module_call_s" in c else ""))


def cell_value(rec):
    """What a tool's table cell shows: its time, or why there is none."""
    if rec is None:
        return "-"
    if rec.get("status") != "ok":
        return rec.get("status", "err")
    return fmt_us(rec.get("us"))


def summarize(cell, tools):
    """Derived numbers of one cell: speedups, fraction of floor, best other tool, errors."""
    res = cell.get("results", {})
    ok = {k: r for k, r in res.items() if r.get("status") == "ok" and r.get("us")}
    floor = cell.get("floor_us")
    for rec in ok.values():
        rec["pct_floor"] = 100.0 * floor / rec["us"] if floor else None
    others = {k: r["us"] for k, r in ok.items() if not _is_fxfuse(k, tools)}
    best_other = min(others, key=others.get) if others else None
    head = ok.get(HEADLINE)
    best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
    s = {
        "best": best,
        "best_other": best_other,
        "x_eager": res["eager"]["us"] / head["us"] if head and "eager" in ok else None,
        "x_best_other": others[best_other] / head["us"] if head and best_other else None,
        "pct_floor": (head or {}).get("pct_floor"),
        "pct_floor_best": ok[best]["pct_floor"] if best else None,
        "max_err": max((r["rel_err"] for r in ok.values() if "rel_err" in r), default=None),
    }
    cell["summary"] = s
    return s


def _is_fxfuse(key, tools):
    return any(t.key == key and t.fxfuse for t in tools)


class Report:
    """Accumulates cells and writes them; one per benchmark run."""

    def __init__(self, meta, tools, out=None):
        self.meta, self.tools, self.cells = meta, tools, []
        self.dir = Path(out or RESULTS) / slug(meta["device"])
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"{meta['benchmark']}_{time.strftime('%Y%m%d-%H%M%S')}"
        self.json_path = self.dir / f"{stem}.json"
        self.md_path = self.dir / f"{stem}.md"
        self.stem = stem
        self.notes = []
        self.has_head = any(t.key == HEADLINE for t in tools)
        self.has_compile = any(t.key == "compile" for t in tools)

    def add(self, cell):
        summarize(cell, self.tools)
        self.cells.append(cell)

    # ------------------------------------------------------------------ table
    def headers(self):
        params = list(self.cells[0]["params"]) if self.cells else []
        h = params + ["floor us", "bound"] + [t.label for t in self.tools]
        if self.has_head:
            h += ["x eager", "x best other", "best other", "%floor fxfuse",
                  "fxfuse s", "fxfuse kern/lib"]
        h += ["%floor best"] + (["compile s"] if self.has_compile else []) + ["max rel err"]
        return h

    def row(self, cell):
        s, res = cell.get("summary", {}), cell.get("results", {})
        row = list(cell["params"].values())
        if "skipped" in cell:
            return row + ["skip"] + [""] * (len(self.headers()) - len(row) - 1)
        row += [fmt_us(cell.get("floor_us")), cell.get("floor_bound", "-")]
        row += [cell_value(res.get(t.key)) for t in self.tools]
        pct = ["-" if s.get(k) is None else f"{s[k]:.0f}%"
               for k in ("pct_floor", "pct_floor_best")]
        if self.has_head:
            head = res.get(HEADLINE, {})
            st = head.get("stats") or {}
            kl = (f"{st.get('fused_kernels', '?')}/{st.get('library_calls', '?')}"
                  if st else "-")
            best = next((t.label for t in self.tools if t.key == s.get("best_other")), "-")
            build = head.get("build_s") if head.get("status") == "ok" else None
            row += [fmt_x(s.get("x_eager")), fmt_x(s.get("x_best_other")), best, pct[0],
                    "-" if build is None else f"{build:.2f}", kl]
        row += [pct[1]]
        if self.has_compile:
            comp = res.get("compile", {})
            row += ["-" if comp.get("status") != "ok" else f"{comp['build_s']:.2f}"]
        row += [fmt_err(s.get("max_err"))]
        return row

    def table(self, fmt="github"):
        return tabulate([self.row(c) for c in self.cells], headers=self.headers(),
                        tablefmt=fmt, disable_numparse=True)

    def print_table(self):
        print(f"\n{self.meta['benchmark']} on {self.meta['device']}, {self.meta['dtype']}, "
              f"per-call us (median of repetitions of back-to-back calls, "
              f"{self.meta.get('timing', 'sequential')} tools)")
        print(self.table())

    # ------------------------------------------------------------------ files
    def failures(self):
        """One line per distinct (tool, status, error): n/a and err reasons, fxfuse warnings.

        fxfuse's warnings matter: a fallback to the original module would make its column
        an eager measurement, so they are shown, not only kept in the JSON.
        """
        seen = {}
        for cell in self.cells:
            for key, rec in cell.get("results", {}).items():
                if rec.get("status") in ("n/a", "err"):
                    seen.setdefault((key, rec["status"], rec.get("error", "")), []).append(
                        cell["label"])
                for warning in rec.get("warnings", []) if _is_fxfuse(key, self.tools) else []:
                    seen.setdefault((key, "warned", warning), []).append(cell["label"])
        return [f"`{k}` {st}: {err} ({len(cells)} cell(s), first: {cells[0]})"
                for (k, st, err), cells in seen.items()]

    def write(self):
        doc = dict(self.meta, tools=[{"key": t.key, "label": t.label, "fxfuse": t.fxfuse}
                                     for t in self.tools],
                   headline=HEADLINE, notes=self.notes, cells=self.cells)
        self.json_path.write_text(json.dumps(doc, indent=1, default=str))
        self.md_path.write_text(self.markdown())

    def markdown(self):
        m = self.meta
        lines = [f"# {m['benchmark']} on {m['device']}", "",
                 f"- when: {m['timestamp']}; command: `{m['command']}`",
                 f"- torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
                 f"python {m['python']}, commit {m.get('git_commit')}",
                 f"- dtype {m['dtype']}; precision {m['precision']}"]
        if "ceilings" in m:
            lines.append(f"- ceilings: {ceilings_line(m['ceilings'])}")
        order = m.get("timing", "sequential")
        lines += ["- times: per-call microseconds, median of repetitions of back-to-back "
                  f"calls, tools timed {ORDER_TEXT.get(order, order)}; floor = max(FLOPs / matmul rate, min bytes / copy bandwidth, "
                  "one launch); `x best other` = fxfuse speedup over the fastest non-fxfuse "
                  "column; `s` columns = build + first call (compile) in seconds; rel err = "
                  "||out - ref|| / ||ref|| against float64.", "", self.table(), ""]
        notes = [f"{c['label']}: {c['skipped']}" for c in self.cells if "skipped" in c]
        notes += [f"{c['label']}: {n}" for c in self.cells for n in c.get("notes", [])]
        notes += self.failures() + self.notes
        if notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
        return "\n".join(lines)

    # ------------------------------------------------------------------ heatmaps
    def heatmaps(self, row_key, col_key, group_key):
        """One PNG per `group_key` value: fxfuse speedup over the best other tool."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self._note("heatmap skipped: matplotlib is not installed (pip install .[bench])")
            return []
        points = [(c["params"], c.get("summary", {}).get("x_best_other")) for c in self.cells]
        points = [(p, v) for p, v in points if v is not None and row_key in p and col_key in p]
        if not points:
            self._note("heatmap skipped: no cell has an fxfuse speedup to plot")
            return []
        paths = []
        for group in sorted({p.get(group_key) for p, _ in points}, key=str):
            pts = [(p, v) for p, v in points if p.get(group_key) == group]
            rows = sorted({p[row_key] for p, _ in pts})
            cols = sorted({p[col_key] for p, _ in pts})
            grid = [[math.nan] * len(cols) for _ in rows]
            for p, v in pts:
                grid[rows.index(p[row_key])][cols.index(p[col_key])] = v
            paths.append(self._plot(plt, grid, rows, cols, row_key, col_key, group_key, group))
        self.write()
        return paths

    def _plot(self, plt, grid, rows, cols, row_key, col_key, group_key, group):
        logs = [[math.log2(v) if v == v else math.nan for v in r] for r in grid]
        span = max([abs(v) for r in logs for v in r if v == v] + [0.5])
        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(cols), 1.2 + 0.6 * len(rows)))
        im = ax.imshow(logs, cmap="RdYlGn", vmin=-span, vmax=span, aspect="auto")
        for i, r in enumerate(grid):
            for j, v in enumerate(r):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel(col_key)
        ax.set_ylabel(row_key)
        ax.set_title(f"fxfuse speedup over best other tool\n{self.meta['device']}, "
                     f"{self.meta['dtype']}, {group_key}={group}", fontsize=9)
        bar = fig.colorbar(im, ax=ax, label="speedup (log scale)")
        nice = [1 / 16, 1 / 8, 1 / 4, 1 / 2, 0.8, 1, 1.25, 2, 4, 8, 16]
        ticks = [math.log2(v) for v in nice if abs(math.log2(v)) <= span]
        bar.set_ticks(ticks, labels=[f"{2.0 ** t:.3g}x" for t in ticks])
        fig.tight_layout()
        path = self.dir / f"{self.stem}_heatmap_{group_key}{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        self._note(f"heatmap: {path.name}")
        return path

    def _note(self, text):
        self.notes.append(text)
        print(text, file=sys.stderr)


def progress_line(cell, tools):
    """The short per-cell summary printed on stderr while a long run goes on."""
    if "skipped" in cell:
        return f"skipped: {cell['skipped']}"
    parts = [f"{t.key} {cell_value(cell['results'].get(t.key))}" for t in tools]
    return f"floor {fmt_us(cell.get('floor_us'))} | " + " | ".join(parts)
