"""What may form a parallel residual (`declare_ffn(parallel_residual=True)`), checked once at
construction.

A parallel-residual layer is `h + attn(n1(h)) + mlp(n2(h))`. The FFN reads the residual the
attention read (the attention's output is still pending on the stream), carries the attention's
output to its own exit and adds it to its own partial output, so one sum over TP completes both
(deferred to the next input like any FFN sum, where a fused all-reduce + add + norm can take it).
That is only the layer's value when both outputs are plain additions to the same residual,
neither changes before the sum, and the FFN's read leaves the residual as it is; everything
else is refused here, naming the stage.
"""

from __future__ import annotations

from ._contracts import ProducerReduction
from ._fusions import read_format
from ._paths import writes_at_exit

__all__ = ["check_parallel_branch"]

_WHAT = "a parallel-residual FFN (declare_ffn(parallel_residual=True))"


def check_parallel_branch(stage) -> None:
    """Raise ValueError naming `stage` when its declaration cannot form a parallel residual."""
    decl = stage.declaration
    prev = decl.previous

    def refuse(reason: str, fix: str) -> None:
        raise ValueError(f"stage {stage.label}: {_WHAT} {reason}; {fix}")

    if decl.prepared_from is not None:
        refuse("cannot start a prepared branch (prepared_from=)", "build it right after the attention it runs beside")
    if prev is None:
        refuse("needs the attention it runs beside as its previous stage",
               "build it after that attention (in one make_stages call, or previous= the attention's declaration)")
    if not prev.is_attention_like:
        refuse(f"runs beside an attention, but its previous stage is {prev.describe()}",
               "declare it right after an attention (declare_attn), or drop parallel_residual")
    if decl.sparse:
        refuse("cannot be a MoE: a finalize handoff (defer_moe_finalize) and the expert output group cannot join the "
               "attention's sum", "declare a dense FFN, or drop parallel_residual")
    if decl.reduction is not ProducerReduction.SCOPED:
        refuse(f"leaves its sum to the boundary, which {decl.reduction.name} compute does not (it adds a component after "
               "its own sum)", "declare it with the default reduction=ProducerReduction.SCOPED")
    for whose, d in (("the attention's", prev), ("its own", decl)):
        update = d.update
        if not update.plain_add:
            refuse(f"adds both outputs to the residual as one sum, but {whose} update {update!r} is not a plain add "
                   "(plain_add=False)", "declare both stages on the plain residual, or drop parallel_residual")
        if writes_at_exit(update):
            refuse(f"joins both outputs before the residual update, but {whose} update {update!r} runs at its producer "
                   "(at_producer=True or outlives_layer=False)", "use an update that waits for the next input")
        if d.output_transform is not None:
            refuse(f"sums both outputs together, but {whose} output_transform {d.output_transform.name!r} needs that "
                   "output's complete sum first", "apply it inside compute, or declare the two stages sequentially")
    if read_format(decl.read) is None:
        refuse(f"reads the residual the attention read, but its read {decl.read!r} is neither a plain norm nor a "
               "quantizing norm read, so it may change that residual", "use the plain read (the default)")
    topology = stage.parallel.topology
    if topology.attn_cp > 1:
        refuse(f"has no context-parallel path (attn_cp={topology.attn_cp}): the attention's output lies on this CP rank's "
               "rows and the FFN's on full rows", "run with attn_cp=1, or declare the two stages sequentially")
