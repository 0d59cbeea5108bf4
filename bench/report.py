"""Markdown tables from a results.json: `python -m bench.report DIR/results.json`.

After the tables, the speed and memory targets the library is held to on a GPU (`TARGETS`), each
read from the same run's records: the measured ratio, the bound, met or not. A target whose
records the run lacks (another device, a subset of implementations) says "not measured".
"""

from __future__ import annotations

import argparse
import json
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


# (family, case label, implementation, what is compared, bound). What is compared, all fwd+bwd
# unless named: "/ IMPL" the time's ratio to IMPL's on the same case (at most the bound),
# "roofline" the fraction of the roofline reached (at least the bound), "peak / logits" the extra
# peak memory over the bf16 logits' size (at most), "fwd roofline" the forward's fraction. The
# forward's is read from `ftis_loss_3pass`: the default writes the gradient in its forward (the
# backward's read and write), which its one-read roofline cannot count.
TARGETS = (
    *(
        ("logits", label, impl, what, bound)
        for label in ("16kx151936 bf16", "16kx151936 fp32")
        for impl in ("ftis_loss", "ftis_loss_filter")
        for what, bound in (("/ liger_triton", 0.95), ("roofline", 0.85))
    ),
    *(
        ("logits", label, "ftis_loss_inplace", "/ liger_triton_inplace", 1.0)
        for label in ("16kx151936 bf16", "16kx151936 fp32")
    ),
    ("logits", "16kx151936 bf16", "ftis_loss_3pass", "fwd roofline", 0.9),
    *(
        ("logits", "1kx151936 bf16", impl, "/ liger_triton", 1.2)
        for impl in ("ftis_loss", "ftis_loss_filter")
    ),
    *(
        ("linear", label, impl, what, bound)
        for label in ("16kx151936 bf16 H1536", "16kx151936 bf16 H4096")
        for impl in ("ftis_linear_loss", "ftis_linear_loss_wacc")
        for what, bound in (
            ("roofline", 0.8),
            ("/ trl_fused", 1.0),
            ("/ ftis_loss", 1.0),
            ("peak / logits", 0.3),
        )
    ),
)


def _target_value(by: dict, family: str, label: str, impl: str, what: str):
    """(the measured value, None), or (None, why it was not measured)."""
    mode = "fwd" if what == "fwd roofline" else "fwd+bwd"
    r = by.get((family, label, impl), {}).get(mode)
    if r is None or r["status"] != "ok":
        return None, f"{impl} {mode} {'not run' if r is None else r['status']}"
    if what.startswith("/ "):
        other = what[2:]
        b = by.get((family, label, other), {}).get("fwd+bwd")
        if b is None or b["status"] != "ok":
            return None, f"{other} {'not run' if b is None else b['status']}"
        return r["time_ms"]["median"] / b["time_ms"]["median"], None
    if what in ("roofline", "fwd roofline"):
        frac = r.get("roofline_fraction")
        return (frac, None) if frac is not None else (None, "no roofline in the record")
    if what == "peak / logits":
        over = r.get("peak_over_logits")
        return (over, None) if over is not None else (None, "no peak in the record")
    raise ValueError(f"unknown target measure {what!r}")


def targets(results: dict) -> str:
    """The `TARGETS` table: each target's measured value, bound and verdict."""
    by: dict = defaultdict(dict)
    for r in results["records"]:
        by[(r["case"]["family"], r["case"]["label"], r["impl"])][r["mode"]] = r
    if not {(f, label) for f, label, *_ in TARGETS} & {(f, label) for f, label, _ in by}:
        return "No target's case in this run: the targets are GPU shapes (`report.TARGETS`).\n"
    lines = [
        "### Targets (this run's records)",
        "",
        "| case | implementation | measure | value | bound | met |",
        "|---|---|---|---|---|---|",
    ]
    met = total = 0
    for family, label, impl, what, bound in TARGETS:
        value, why = _target_value(by, family, label, impl, what)
        at_least = what in ("roofline", "fwd roofline")
        bound_shown = f">= {100 * bound:.0f}%" if at_least else f"<= {bound:.2f}"
        if value is None:
            lines.append(f"| {label} | {impl} | {what} | not measured ({why}) | {bound_shown} | |")
            continue
        ok = value >= bound if at_least else value <= bound
        met, total = met + ok, total + 1
        shown = f"{100 * value:.1f}%" if at_least else f"{value:.3f}"
        lines.append(
            f"| {label} | {impl} | {what} | {shown} | {bound_shown} | {'yes' if ok else '**no**'} |"
        )
    lines += [
        "",
        f"Met {met} of the {total} targets measured ({len(TARGETS)} in all). In the linear "
        "family `ftis_loss` is the materialised path (`hidden @ weight.T`, then `ftis_loss`); "
        "`roofline` there is the three GEMMs' at the matmul rate measured in the run.",
        "",
    ]
    return "\n".join(lines)


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
    # Implementations that could not run here (Liger without liger-kernel, or off CUDA): one
    # line, not a row each.
    unavailable: dict[str, str] = {}
    for r in results["records"]:
        if r["status"] == "unavailable":
            unavailable.setdefault(r["impl"], r.get("reason", ""))
    if unavailable:
        lines.append(
            "Unavailable: "
            + "; ".join(f"{impl} ({why[:120]})" for impl, why in unavailable.items())
        )
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Print a bench.run results.json as its tables and the GPU goals.",
    )
    ap.add_argument("results", help="a results.json written by python -m bench.run")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    print(markdown(results) + "\n" + targets(results))


if __name__ == "__main__":
    main()
