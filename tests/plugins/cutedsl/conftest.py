"""The one-shot all-reduce GPU tests' table, printed at the end of a pytest run that ran them."""

import sys


def _fmt(value):
    return "-" if value is None else f"{value:.3f}"


def pytest_terminal_summary(terminalreporter):
    rows = []
    for name, module in list(sys.modules.items()):
        if name.endswith("test_allreduce_gpu"):
            rows.extend(getattr(module, "RESULTS", []))
    if not rows:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("-", "one-shot all-reduce on the GPU (err/bound: ok <= 1)")
    worlds = sorted({r.get("world", "") for r in rows})
    for world in worlds:
        write(f"world: {world}")
    cases = {}
    for r in rows:
        cases.setdefault((r.get("ranks"), r["case"]), []).append(r)
    write(f"{'ranks':>5}  {'case':46} {'normed':>7} {'resid':>7} {'unfused':>7}  {'ranks agree':11} result")
    for (ranks, case), group in cases.items():
        def worst(key):
            values = [g[key] for g in group if g.get(key) is not None]
            return max(values) if values else None

        agree = len({g.get("digest") for g in group}) == 1
        ok = all(g["ok"] for g in group) and agree
        detail = "; ".join(sorted({g["detail"] for g in group if g.get("detail")}))
        write(
            f"{ranks:>5}  {case:46} {_fmt(worst('err_normed')):>7} {_fmt(worst('err_residual')):>7} {_fmt(worst('vs_unfused')):>7}  "
            f"{'yes' if agree else 'NO':11} {'ok' if ok else 'FAIL'}" + (f"  {detail}" if detail else "")
        )
