"""Markdown tables from a results.json: `python -m bench.report DIR/results.json`."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

MiB = 2**20


def header(results: dict) -> str:
    m, c = results["meta"], results["ceilings"]
    return (
        f"Machine: {m['device_name']}; torch {m['torch']}, triton {m['triton']}, "
        f"liger-kernel {m['liger_kernel'] or 'not installed'}; commit {m['commit']}; {m['date']}.  \n"  # noqa: E501
        f"Ceilings measured in the same run: copy {c['copy_GBps']:.1f} GB/s (read + write), matmul "
        f"{c['matmul_TFLOPs']['bfloat16']:.2f} TFLOP/s bf16, {c['matmul_TFLOPs']['float32']:.2f} fp32."  # noqa: E501
    )


def _fmt_time(r: dict) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    t = r["time_ms"]
    return f"{t['median']:.3g} ({t['p20']:.3g}-{t['p80']:.3g})"


def _fmt_mem(r: dict) -> str:
    if r is None or r["status"] != "ok":
        return ""
    return f"{r['peak_extra_bytes'] / MiB:.1f}"


def _ratio(r: dict, base: dict, key) -> str:
    if r is None or base is None or r["status"] != "ok" or base["status"] != "ok":
        return ""
    a, b = key(r), key(base)
    return f"{a / b:.2f}x" if b else ""


def markdown(results: dict) -> str:
    """One table per family: rows are case x implementation, columns fwd and fwd+bwd."""
    by = defaultdict(dict)
    order = []
    for r in results["records"]:
        key = (r["case"]["family"], r["case"]["label"], r["impl"])
        if key not in by:
            order.append(key)
        by[key][r["mode"]] = r
    lines = [header(results), ""]
    for family in ("logits", "linear"):
        keys = [k for k in order if k[0] == family]
        if not keys:
            continue
        lines += [
            f"### {family} family"
            + (
                " (input: logits (B, T, V))"
                if family == "logits"
                else " (inputs: hidden (B, T, H), lm-head weight (V, H))"
            ),
            "",
            "| shape | implementation | fwd ms median (p20-p80) | fwd peak MiB | fwd+bwd ms median (p20-p80) "  # noqa: E501
            "| fwd+bwd peak MiB | fwd+bwd time / eager | fwd+bwd peak / eager | fwd+bwd peak / logits size "  # noqa: E501
            "| roofline ms (fwd+bwd) | of roofline | loss rel. err |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for fam, label, impl in keys:
            fwd, fb = by[(fam, label, impl)].get("fwd"), by[(fam, label, impl)].get("fwd+bwd")
            base = by.get((fam, label, "ref_eager"), {}).get("fwd+bwd")
            if (
                fwd is not None
                and fwd["status"] == "unavailable"
                and (fb is None or fb["status"] == "unavailable")
            ):
                continue
            main = fb if fb is not None and fb["status"] == "ok" else fwd
            roof = f"{fb['roofline_ms']:.3g}" if fb is not None else ""
            frac = (
                f"{100 * fb['roofline_fraction']:.0f}%"
                if fb is not None and fb.get("roofline_fraction")
                else ""
            )
            err = (
                f"{main['loss_rel_err']:.1e}"
                if main is not None and main.get("loss_rel_err") is not None
                else ""
            )
            over = (
                f"{fb['peak_over_logits']:.2f}"
                if fb is not None and fb.get("peak_over_logits") is not None
                else ""
            )
            fwd_t = "n/a" if fwd is not None and fwd["status"] == "unavailable" else _fmt_time(fwd)
            lines.append(
                f"| {label} | {impl} | {fwd_t} | {_fmt_mem(fwd)} | {_fmt_time(fb)} | {_fmt_mem(fb)} "  # noqa: E501
                f"| {_ratio(fb, base, lambda r: r['time_ms']['median'])} "
                f"| {_ratio(fb, base, lambda r: r['peak_extra_bytes'])} | {over} | {roof} | {frac} | {err} |"  # noqa: E501
            )
        lines.append("")
    skipped = [r for r in results["records"] if r["status"] not in ("ok", "unavailable")]
    if skipped:
        lines.append(
            "Not measured: "
            + "; ".join(
                f"{r['case']['label']} {r['impl']} {r['mode']}: {r['status']} ({r.get('reason', '')[:120]})"  # noqa: E501
                for r in skipped
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))
