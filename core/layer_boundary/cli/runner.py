"""Running a model family's model on one rank: prefill then decode steps, with timings and counts.

The same function runs in spawned ranks, under torchrun, and in the test worlds; it knows a
family only through its registered `ModelFamily` record (build, load weights) and the model's
calling convention (`model(input_ids, forward, step, cache)`, `new_cache()`, and optionally
`forward_extras(step)`: per-forward facts the model's stages read).

What the rank ran is recorded as it is chosen: every selection made while the model is built and
prepared, and (in eager runs) every fusion candidate's answers per stage (`kernel_report`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import attrs
import torch

from .._families import StepLayout
from .._forward import DpPadding, Forward, ForwardMode
from .._fusions import counting_candidates
from .._lifecycle import prepare_model, release_model
from .._plugins.requests import TokenMappingRequest
from .._plugins.selection import recording, select
from ..collectives import CollectiveCounter, CountingCollectives
from ..nodes import node_hash, node_layout
from .families import build, family_config, find_family
from .kernel_report import rank_report
from .progress import progress
from .sources import open_source

__all__ = ["RunJob", "run_rank", "make_requests", "token_mapping", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class RunJob:
    model: str
    hf_config: dict
    topology: object
    reduction: str
    dtype: str
    device: str = "cpu"
    weights: Optional[str] = None  # a torch.save'd state dict
    checkpoint: Optional[str] = None  # a checkpoint folder
    prompts: tuple = ()
    decode_tokens: tuple = ()
    sequence_parallel: bool = False
    dp_padding: str = "sum_len"
    #: draw a progress bar on rank 0's stderr (a terminal, and no --json)
    progress: bool = False
    #: run options for the family (`BuildRequest.options`), also every forward's `extras`:
    #: "lora" (adapter count), "lora_seed" and "lora_assignment" (a slot per request, -1: none),
    #: "fp8", "tbo", "cp_order"
    options: dict = attrs.field(factory=dict)
    #: run every step through `torch.compile(model, backend=compile, fullgraph=True)` (a backend
    #: name: "eager", "aot_eager", "inductor"); the result reports the graphs compiled
    compile: Optional[str] = None
    #: "record": record what every MoE router chose (the model's `routed_layers()`), per step and
    #: token, into the result's "routing"; a `PinnedRouting`: route every token as it says, and
    #: record the choices this model would have made (a reference run; see `routing.py`)
    routing: Any = None


def make_requests(vocab: int, batch: int, prompt_tokens: int, decode_steps: int, seed: int):
    """Prompts of uneven lengths (prompt_tokens - 1, prompt_tokens, prompt_tokens + 1, ...) and
    the decode tokens fed at each step (teacher forcing, so every run sees the same inputs)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [max(1, prompt_tokens + (i % 3) - 1) for i in range(batch)]
    prompts = tuple(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in lengths)
    decode = tuple(tuple(torch.randint(0, vocab, (batch,), generator=gen).tolist()) for _ in range(decode_steps))
    return prompts, decode


def token_mapping(parallel, lengths, order, device):
    """The token mapping of a context-parallel batch, from the installed CP plugin
    (`layer_boundary_token_mappings`)."""
    from .._errors import missing_feature

    chosen = select("token_mappings", (TokenMappingRequest(parallel, lengths, order, device),), subject="mapping a CP batch's tokens")
    if chosen.chosen is None:
        raise missing_feature(f"a context-parallel batch (attn_cp={parallel.topology.attn_cp})", "cp")
    return chosen.value


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run_rank(parallel, job: RunJob, *, fusions=None) -> dict:
    """Build, load and run the model on this rank; return its DP group's logits and measurements.

    `fusions`: a fusion provider given to every stage (`fusions=` stage option).
    """
    counter = CollectiveCounter()
    counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    device = job.device
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    item = find_family(job.model)
    config = family_config(item, job.hf_config)
    dtype = DTYPES[job.dtype]
    t0 = time.perf_counter()
    with recording() as selections:  # every choice the build and the plugins' preparation make
        model = build(item, config, counted, reduction=job.reduction, fusions=fusions, dtype=dtype, device=device, options=job.options)
        source = open_source(torch.load(job.weights, map_location="cpu") if job.weights else None, job.checkpoint)
        item.record.load_weights(model, source)
        # plugins' workspaces and kernels, sized for the largest step (the prefill), on every rank
        prepare_model(model, max_tokens=max(1, sum(len(p) for p in job.prompts)))
    extras_of = getattr(model, "forward_extras", None)
    build_s = time.perf_counter() - t0
    # where the ranks run: this rank's node, and its groups' node layouts (one all_gather each,
    # so every member of a group holds the same table; uncounted, before the first step)
    groups = {name: node_layout(parallel.groups[name]).nodes for name in ("tp", "pp")}
    topo = parallel.topology
    dp, dp_rank = topo.attn_dp, parallel.attn_dp_rank
    mine = [r for r in range(len(job.prompts)) if r % dp == dp_rank]
    requests_of = lambda per_request: tuple(tuple(per_request(r) for r in range(len(job.prompts)) if r % dp == d) for d in range(dp))  # noqa: E731
    cache = model.new_cache()
    run_model, backend = model, None
    recorder = None
    if job.routing is not None:
        from .routing import RoutingRecorder

        if job.compile:
            raise ValueError("a run that records or pins routing runs eagerly; drop compile or routing")
        recorder = RoutingRecorder(model, job, parallel, pins=None if job.routing == "record" else job.routing)
    if job.compile:
        from ..compiling import CountingBackend, graph_breaks

        torch._dynamo.reset()  # a fresh cache: counts of this run only, and no earlier run's recompile budget spent
        breaks_before = graph_breaks()
        backend = CountingBackend(job.compile)
        run_model = torch.compile(model, backend=backend, fullgraph=True)
    logits: dict[int, list] = {r: [] for r in mine}
    steps = [("prefill", ForwardMode.EXTEND)] + [(f"decode{s + 1}", ForwardMode.DECODE) for s in range(len(job.decode_tokens))]
    timings: dict[str, float] = {}
    collectives: dict[str, dict] = {}
    # a bar on rank 0 (the launcher decided whether its stderr is a terminal: job.progress)
    bar = progress(len(steps), "  run", enabled=job.progress and parallel.rank == 0)
    # eager forwards count each fusion candidate's answers; a compiled graph replays what it traced
    counting = counting_candidates() if job.compile is None else contextlib.nullcontext(None)
    with counting as answers:
        for index, (name, mode) in enumerate(steps):
            if index == 0:
                ids = [torch.tensor(job.prompts[r]) for r in mine]
                per_request = requests_of(lambda r: len(job.prompts[r]))
                step = StepLayout(mine, [len(job.prompts[r]) for r in mine], [0] * len(mine), device=device, dp_request_counts=per_request)
            else:
                ids = [torch.tensor([job.decode_tokens[index - 1][r]]) for r in mine]
                per_request = requests_of(lambda r: 1)
                past = [len(job.prompts[r]) + index - 1 for r in mine]
                step = StepLayout(mine, [1] * len(mine), past, device=device, dp_request_counts=per_request)
            dp_counts = tuple(sum(counts) for counts in per_request)
            input_ids = (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)).to(device)
            # prefill under attention CP is a CP batch (each CP rank computes its share of the rows); decode is ordinary
            cp = token_mapping(counted, step.counts, job.options.get("cp_order"), device) if topo.attn_cp > 1 and index == 0 else None
            fwd = Forward(
                counted,
                step.num_tokens,
                dp_counts=dp_counts,
                dp_padding=DpPadding(job.dp_padding),
                mode=mode,
                sequence_parallel=job.sequence_parallel and mode is ForwardMode.EXTEND,
                cp=cp,
                extras={**job.options, **(extras_of(step) if extras_of is not None else {})},
            )
            if recorder is not None:
                recorder.begin(name, index)
            counter.reset()
            _sync(device)
            start = time.perf_counter()
            out = run_model(input_ids, fwd, step, cache)
            _sync(device)
            timings[name] = time.perf_counter() - start
            collectives[name] = counter.snapshot()
            if out is not None:  # None: an earlier pipeline stage, whose output went to the next stage
                for r, s, c in zip(step.rids, step.starts, step.counts):
                    logits[r].append(out[s : s + c].float().cpu() if dtype in (torch.bfloat16, torch.float16) else out[s : s + c].cpu())
            bar.update(1, step=name)
    bar.close()
    kernels = rank_report(model, selections, answers, job.compile)
    routing = None
    if recorder is not None:
        recorder.restore()
        routing = recorder.export()
    release_model(model)
    report = parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0 and parallel.pp_rank == topo.pp - 1
    return {
        "rank": parallel.rank,
        "logits": logits if report else {},
        "timings": timings,
        "build_s": build_s,
        "node": node_hash(),
        "node_layouts": groups,
        "collectives": collectives,
        "tokens": {name: (sum(len(p) for p in job.prompts) if i == 0 else len(job.prompts)) for i, (name, _) in enumerate(steps)},
        "kernels": kernels,
        "graphs": None if backend is None else backend.graphs,
        "graph_breaks": None if backend is None else graph_breaks() - breaks_before,
        "routing": routing,
    }
