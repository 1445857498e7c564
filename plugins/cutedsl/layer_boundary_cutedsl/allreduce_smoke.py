"""First GPU contact for the one-shot all-reduce: one launch (or a few) per case, each case under
a hard timeout, one line per case, then a summary.

    python -m layer_boundary_cutedsl.allreduce_smoke --ranks 2

Ranks are processes (gpu_world.py): with fewer GPUs than ranks they share GPUs (gloo, CUDA IPC
within the device). The last case runs in a process of its own: a launch whose peer never comes
must trap after its timeout (an error, not a hang). Exit status 0 when every case passed.
Writes nothing (`--json PATH` writes the results there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _cases(ranks: int) -> list:
    from . import allreduce_checks as c

    last = ranks - 1
    return [
        ("boundary bf16 T=1", c.check_boundary, ("bf16", 4096, 0.0, (1,))),
        ("boundary bf16 T=133 (one above a wave)", c.check_boundary, ("bf16", 4096, 0.0, (133,))),
        ("boundary bf16 gemma T=7", c.check_boundary, ("bf16", 4096, 1.0, (7,))),
        ("boundary fp16 h2880 T=7", c.check_boundary, ("fp16", 2880, 0.0, (7,))),
        ("moe finalize k8 + shared T=7", c.check_moe, (2048, 8, True, (7,))),
        ("graph capture, 1 replay", c.check_graph, (4096, 16, 1)),
        (f"rank {last} delayed 0.5 s", c.check_delayed, (last, 0.5)),
    ]


def _line(status: str, name: str, rows: list, seconds: float, note: str = "") -> str:
    def worst(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{max(values):.3f}" if values else "-"

    # one output per (case, launch): every rank must hold the same one
    per_output: dict = {}
    for r in rows:
        if r.get("digest"):
            per_output.setdefault(r["case"], set()).add(r["digest"])
    differing = [case for case, digests in per_output.items() if len(digests) > 1]
    same = "-" if not per_output else ("same on all ranks" if not differing else f"DIFFER ({len(differing)})")
    details = "; ".join(sorted({r["detail"] for r in rows if r.get("detail")}))
    text = (
        f"{status:4}  {name:42} err/bound normed {worst('err_normed'):>6} residual {worst('err_residual'):>6} "
        f"vs unfused {worst('vs_unfused'):>6}  outputs {same}  ({seconds:.1f}s)"
    )
    if details:
        text += f"  [{details}]"
    return text + (f"  {note}" if note else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4, 8))
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds a case may take on all ranks")
    parser.add_argument("--kernel-timeout", type=float, default=20.0, help="seconds a kernel waits for a peer before it traps")
    parser.add_argument("--no-timeout-case", action="store_true", help="skip the trap check")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("FAIL  no CUDA device visible")
        return 2
    from layer_boundary import Topology

    from .gpu_world import gpu_world, world_note

    print(f"one-shot all-reduce smoke: {world_note(args.ranks)}", flush=True)
    env = {"LAYER_BOUNDARY_CUTEDSL_ONESHOT_TIMEOUT_S": str(args.kernel_timeout)}
    results, passed, total = [], 0, 0
    world = gpu_world(args.ranks, timeout=args.case_timeout, env=env)
    start = time.perf_counter()
    try:
        world.start()
        print(f"      {args.ranks} rank processes up ({time.perf_counter() - start:.1f}s)", flush=True)
        for name, fn, fargs in _cases(args.ranks):
            total += 1
            t0 = time.perf_counter()
            try:
                per_rank = world.run(fn, Topology(tp=args.ranks), *fargs, timeout=args.case_timeout)
            except Exception as exc:  # noqa: BLE001 - reported, the next case gets a fresh world
                head = str(exc).strip().splitlines()
                print(f"FAIL  {name:42} {type(exc).__name__}: {' | '.join(head[:1] + head[-2:])}", flush=True)
                results.append({"case": name, "ok": False, "error": str(exc)})
                continue
            rows = [row for rank_rows in per_rank for row in rank_rows]
            digests_ok = len({(r["case"], r["digest"]) for r in rows}) == len({r["case"] for r in rows})
            ok = all(r["ok"] for r in rows) and digests_ok
            passed += ok
            print(_line("PASS" if ok else "FAIL", name, rows, time.perf_counter() - t0), flush=True)
            results.extend(rows)
    finally:
        world.close()
    if not args.no_timeout_case:
        total += 1
        t0 = time.perf_counter()
        from .allreduce_checks import check_timeout_in_subprocess

        row, problem = check_timeout_in_subprocess(2.0, limit=120.0)
        ok = row is not None and row["ok"]
        passed += ok
        name = "kernel timeout traps (own process)"
        print(_line("PASS" if ok else "FAIL", name, [row] if row else [], time.perf_counter() - t0, problem), flush=True)
        results.append(row or {"case": name, "ok": False, "error": problem})
    print(f"{passed}/{total} checks passed in {time.perf_counter() - start:.0f}s ({world_note(args.ranks)})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
