#!/usr/bin/env python3
"""Two nodes, simulated on one Linux machine: `torchrun --nnodes 2` across two network namespaces.

Each namespace holds one end of a veth pair (10.213.0.1 and 10.213.0.2) and runs one torchrun
agent with 2 ranks; gloo talks over the veth (GLOO_SOCKET_IFNAME), the rendezvous store lives on
node 0. Both namespaces keep the machine's hostname unless `--uts` gives each its own (UTS
namespace), so by default only torchrun's node rank tells the nodes apart.

For each model (default qwen3 and qwen3_moe): `layer-boundary run --tp 2 --pp 2` on one node (the
ordinary spawned launcher), then the same run under torchrun across the two nodes (pipeline stage
s on node s, TP inside each node); both save their logits and the two must be equal. Then
`scripts/node_decisions.py` runs on the same two nodes and every rank's node-aware decisions
(node layouts of the TP and PP groups, FlashInfer's one-node rule) are checked to agree across
each group and to match the placement.

Needs root (network namespaces) and iproute2. Prints a summary (or `--json`); exit status 0 when
everything matched, 1 when something did not, 77 when this machine cannot make namespaces.

    scripts/two_nodes.sh                     # qwen3 and qwen3_moe, float64
    scripts/two_nodes.sh --uts --models qwen3 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADDRESSES = ("10.213.0.1", "10.213.0.2")
PORT = 29613
SKIP = 77


class SetupError(RuntimeError):
    """The machine would not make the namespaces or the veth pair (a container without the rights)."""


class Nodes:
    """Two network namespaces joined by a veth pair; removed on exit."""

    def __init__(self, uts: bool):
        tag = f"lb{os.getpid() % 100000}"
        self.names = (f"{tag}n0", f"{tag}n1")
        self.links = (f"{tag}v0", f"{tag}v1")
        self.uts = uts
        self.made: list[str] = []

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode:
            raise SetupError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")

    def __enter__(self) -> "Nodes":
        try:
            for ns in self.names:
                self._ip("netns", "add", ns)
                self.made.append(ns)
            self._ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for ns, link, address in zip(self.names, self.links, ADDRESSES):
                self._ip("link", "set", link, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
                self._ip("-n", ns, "link", "set", link, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []

    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` inside node `node`'s namespace (and its own hostname with --uts)."""
        env = ["env", f"GLOO_SOCKET_IFNAME={self.links[node]}"]
        if self.uts:
            return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c",
                    f'hostname node{node} && exec "$@"', "sh", *env, *argv]
        return ["ip", "netns", "exec", self.names[node], *env, *argv]


def can_make_namespaces() -> str | None:
    """None, or why this machine cannot run the simulation."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"lbprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def torchrun(nodes: Nodes, node: int, per_node: int, target: list[str]) -> list[str]:
    return nodes.command(node, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
        "--nproc-per-node", str(per_node), "--master-addr", ADDRESSES[0], "--master-port", str(PORT), *target,
    ])


def run_two(nodes: Nodes, per_node: int, target: list[str], timeout: float) -> tuple[str, str]:
    """Both agents at once; node 0's stdout (rank 0 reports there) and both stderrs."""
    procs = [subprocess.Popen(torchrun(nodes, n, per_node, target), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for n in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, 9)
        raise RuntimeError(f"the two-node run did not finish in {timeout:.0f}s: {' '.join(target)}") from None
    errors = "\n".join(f"--- node {n} ---\n{err[-4000:]}" for n, (_, err) in enumerate(outs))
    if any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        raise RuntimeError(f"the two-node run failed (exit codes {codes}): {' '.join(target)}\n{errors}")
    return outs[0][0], errors


def run_args(model: str, args, logits: Path) -> list[str]:
    return ["-m", "layer_boundary", "run", "--model", model, "--tp", str(args.tp), "--pp", "2",
            "--dtype", args.dtype, "--decode-steps", str(args.decode_steps), "--save-logits", str(logits), "--json"]


def compare(one: Path, two: Path) -> float:
    import torch

    a, b = torch.load(one)["logits"], torch.load(two)["logits"]
    if sorted(a) != sorted(b) or any(len(a[r]) != len(b[r]) for r in a):
        return float("inf")
    return max((x.double() - y.double()).abs().max().item() for r in a for x, y in zip(a[r], b[r]))


def check_model(nodes: Nodes, model: str, args, out: Path) -> dict:
    one, two = out / f"{model}-one-node.pt", out / f"{model}-two-nodes.pt"
    start = time.monotonic()
    single = subprocess.run([sys.executable, *run_args(model, args, one)], cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if single.returncode:
        raise RuntimeError(f"the one-node run of {model} failed:\n{single.stderr[-4000:]}")
    one_s = time.monotonic() - start
    start = time.monotonic()
    stdout, _ = run_two(nodes, args.tp, run_args(model, args, two), args.timeout)
    two_s = time.monotonic() - start
    report = json.loads(stdout)
    diff = compare(one, two)
    nodes_seen = report["config"]["nodes"]
    ok = (diff <= args.max_diff and report["check"]["passed"] is True and nodes_seen["count"] == 2
          and nodes_seen["tp_within_a_node"] and not nodes_seen["pp_within_a_node"])
    return {
        "model": model, "ok": ok, "max_abs_diff_vs_one_node": diff, "check_vs_hf": report["check"],
        "nodes": nodes_seen, "collectives": report["collectives"], "one_node_s": round(one_s, 1), "two_nodes_s": round(two_s, 1),
    }


def check_decisions(nodes: Nodes, args) -> dict:
    stdout, _ = run_two(nodes, args.tp, [str(ROOT / "scripts" / "node_decisions.py")], args.timeout)
    ranks = json.loads(stdout.strip().splitlines()[-1])
    problems = []
    world = len(ranks)
    for layout in ranks[0]["layouts"]:
        for name in ("tp", "pp"):
            views: dict[tuple, list] = {}
            for r in ranks:
                v = r["layouts"][layout][name]
                views.setdefault(tuple(v["ranks"]), []).append(v)
            for members, seen in views.items():
                first = seen[0]
                if any(v["nodes"] != first["nodes"] or v["flashinfer"] != first["flashinfer"] for v in seen):
                    problems.append(f"{layout} {name} group {list(members)}: ranks disagree: {seen}")
                spans = len(set(first["nodes"])) > 1
                expect_spans = len({m // args.tp for m in members}) > 1  # node n holds ranks n*tp ...
                if spans != expect_spans:
                    problems.append(f"{layout} {name} group {list(members)}: seen on nodes {first['nodes']}")
                fi = first["flashinfer"]
                if fi is not None and fi["available"] == spans:
                    problems.append(f"{layout} {name} group {list(members)}: flashinfer decided {fi}")
    summary = {
        r["rank"]: {layout: {n: r["layouts"][layout][n]["flashinfer"]["action"] if r["layouts"][layout][n]["flashinfer"] else None
                             for n in ("tp", "pp")} for layout in r["layouts"]} for r in ranks
    }
    return {"ok": not problems, "problems": problems, "world": world, "flashinfer_actions": summary,
            "node_keys_differ": len({r["node_key"] for r in ranks}) == 2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3", "qwen3_moe"])
    ap.add_argument("--tp", type=int, default=2, help="ranks per node (TP inside each node)")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--max-diff", type=float, default=0.0, help="largest logit difference allowed vs the one-node run (default: equal)")
    ap.add_argument("--uts", action="store_true", help="give each namespace its own hostname (node0, node1)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    why = can_make_namespaces()
    if why:
        print(f"two_nodes: skipped: {why}", file=sys.stderr)
        return SKIP
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result = {"uts": args.uts, "tp_per_node": args.tp, "dtype": args.dtype, "models": []}
    try:
        with tempfile.TemporaryDirectory(prefix="two-nodes-") as tmp, Nodes(args.uts) as nodes:
            for model in args.models:
                result["models"].append(check_model(nodes, model, args, Path(tmp)))
            result["decisions"] = check_decisions(nodes, args)
    except SetupError as exc:
        print(f"two_nodes: skipped: {exc}", file=sys.stderr)
        return SKIP
    result["ok"] = all(m["ok"] for m in result["models"]) and result["decisions"]["ok"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for m in result["models"]:
            print(f"{m['model']}: {'OK' if m['ok'] else 'FAIL'}  two nodes vs one node: max abs logit diff {m['max_abs_diff_vs_one_node']:.3e}; "
                  f"vs HF rel err {m['check_vs_hf']['rel_err']:.3e}; nodes {m['nodes']['of_rank']}; "
                  f"{m['one_node_s']} s one node, {m['two_nodes_s']} s two nodes")
        d = result["decisions"]
        actions = {json.dumps(v, sort_keys=True) for v in d["flashinfer_actions"].values()}
        same = f"the same on all {d['world']} ranks" if len(actions) == 1 else "DIFFERENT across ranks"
        print(f"node-aware decisions: {'OK' if d['ok'] else 'FAIL'}  flashinfer workspace per layout and group, {same}: "
              + "; ".join(sorted(actions)))
        for p in d["problems"]:
            print(f"  {p}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
