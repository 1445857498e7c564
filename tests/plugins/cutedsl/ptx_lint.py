"""Static checks of a kernel's PTX for the ways a launch can hang (pure Python, no GPU).

A CTA hangs when a collective instruction is reached by only some of the threads it waits for:
`bar.sync` by part of the CTA, or a full-mask `shfl.sync`/`vote.sync` by part of a warp (on
sm_70+ the executing lanes wait for the others named in the mask, which may be parked at a
barrier waiting for them). `cute.arch.warp_idx()` is such a trap: it emits a full-mask
`shfl.sync.idx` (its warp-uniform hint), so called inside `if lane == 0:` before a CTA barrier it
deadlocks the CTA (data/hung_add_rmsnorm_bf16_h1024.ptx is a kernel that does).

`divergent_collectives` finds collectives inside thread-divergent control flow: a branch whose
predicate depends (through registers, transitively) on the thread or lane index, or on a value
defined under such a branch. Values computed from parameters, block indices and loads from such
addresses are uniform. It reads the structured, forward-branch/back-edge PTX NVVM emits; it is a
lint, not a proof: it can report a collective whose branch is uniform for reasons it cannot see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Instruction", "parse_body", "divergent_collectives", "required_threads", "lint"]

#: special registers whose value differs between the threads of a CTA or of a warp
_THREAD_VARYING = ("%tid", "%laneid", "%warpid", "%lanemask", "%clock", "%globaltimer", "%smid", "%nsmid")
#: instructions every named thread must reach together (CTA barriers, warp collectives)
_COLLECTIVES = (
    "bar.sync",
    "bar.red",
    "bar.cta.sync",
    "bar.cta.red",
    "barrier.sync",
    "barrier.red",
    "barrier.cta.sync",
    "barrier.cta.red",
    "bar.warp.sync",
    "shfl.sync",
    "vote.sync",
    "match.sync",
    "redux.sync",
    "elect.sync",
    "wgmma.",
    "mma.sync",
    "ldmatrix",
    "stmatrix",
)
#: opcodes whose first operand is not a destination register
_NO_DEST = ("st.", "red.", "bar", "barrier", "bra", "ret", "exit", "fence", "membar", "prefetch", "cp.", "trap", "call")

_LABEL = re.compile(r"^(\$?[A-Za-z_][\w$]*):$")
_REG = re.compile(r"%[A-Za-z_][\w.]*")


@dataclass(frozen=True)
class Instruction:
    index: int
    text: str
    opcode: str
    predicate: str | None  # the guarding predicate register (negation dropped), or None
    dests: tuple
    sources: tuple
    label: str | None  # a branch's target


def _split_operands(rest: str) -> list:
    parts, depth, cur = [], 0, []
    for ch in rest:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_body(ptx: str):
    """(instructions, labels) of the first `.entry` body: labels map a name to the index of
    the instruction that follows it."""
    start = ptx.find(".entry")
    if start < 0:
        raise ValueError("no .entry in this PTX")
    body = ptx[ptx.index("{", ptx.index(")", start)) + 1 :]
    instructions, labels = [], {}
    for raw in body.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith(".reg") or line.startswith(".shared") or line.startswith(".local"):
            continue
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        if line == "}" or not line.endswith(";"):
            continue
        line = line[:-1].strip()
        predicate = None
        if line.startswith("@"):
            guard, line = line.split(None, 1)
            predicate = guard[1:].lstrip("!")
        fields = line.split(None, 1)
        opcode, rest = fields[0], (fields[1] if len(fields) > 1 else "")
        operands = _split_operands(rest)
        label = operands[0] if opcode.startswith("bra") and operands else None
        if operands and not opcode.startswith(_NO_DEST) and not operands[0].startswith("["):
            dests = tuple(_REG.findall(operands[0]))
            srcs = operands[1:]
        else:
            dests, srcs = (), operands
        sources = tuple(r for op in srcs for r in _REG.findall(op))
        if predicate:
            sources += (predicate,)
        instructions.append(Instruction(len(instructions), line, opcode, predicate, dests, sources, label))
    return instructions, labels


def _varying_source(ins: Instruction) -> bool:
    if ins.opcode.startswith(("atom.", "activemask")):
        return True  # atomics hand each thread a different old value
    return any(r.startswith(_THREAD_VARYING) for r in ins.sources)


def _regions(instructions, labels, varying):
    """Index ranges executed under a thread-divergent branch (forward: skipped part; backward:
    the whole loop body)."""
    spans = []
    for ins in instructions:
        if ins.label is None or ins.predicate is None or ins.predicate not in varying:
            continue
        target = labels.get(ins.label)
        if target is None:
            continue
        spans.append(range(ins.index + 1, target) if target > ins.index else range(target, ins.index + 1))
    return spans


def _divergence(instructions, labels):
    varying: set = set()
    while True:
        spans = _regions(instructions, labels, varying)
        inside = {i for span in spans for i in span}
        grown = set(varying)
        for ins in instructions:
            if (
                _varying_source(ins)
                or any(r in varying for r in ins.sources)
                or ins.index in inside
                or (ins.predicate is not None and ins.predicate in varying)
            ):
                grown.update(ins.dests)
        if grown == varying:
            return varying, spans
        varying = grown


def divergent_collectives(ptx: str) -> list:
    """Lines of collectives that sit inside thread-divergent control flow (should be empty)."""
    instructions, labels = parse_body(ptx)
    varying, spans = _divergence(instructions, labels)
    inside = {i for span in spans for i in span}
    found = []
    for ins in instructions:
        if ins.opcode.startswith(_COLLECTIVES) and (ins.index in inside or (ins.predicate is not None and ins.predicate in varying)):
            found.append(ins.text)
    return found


def required_threads(ptx: str):
    """The `.reqntid` block size the kernel was compiled for, or None."""
    m = re.search(r"\.reqntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", ptx)
    if not m:
        return None
    n = 1
    for g in m.groups():
        n *= int(g or 1)
    return n


def lint(ptx: str, threads: int) -> list:
    """Problems that would hang or fail a launch of `threads` threads per CTA (empty: none)."""
    problems = [f"collective under thread-divergent control flow: {t}" for t in divergent_collectives(ptx)]
    req = required_threads(ptx)
    if req is not None and req != threads:
        problems.append(f".reqntid is {req} threads but the launch uses {threads}")
    for m in re.finditer(r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|red\S*|arrive)\s+([^;]+);", ptx):
        args = [a.strip() for a in m.group(1).split(",")]
        counts = [a for a in args[1:2] if a.isdigit()]
        if counts and (int(counts[0]) % 32 or int(counts[0]) > threads):
            problems.append(f"barrier thread count {counts[0]} is not a multiple of 32 up to {threads}: {m.group(0)}")
    return problems
