"""The PTX lint finds a CTA that waits forever: a collective under thread-divergent code, a block
size other than the launch's.

`data/hung_add_rmsnorm_bf16_h1024.ptx` is an add + RMSNorm kernel whose block reduction calls
`cute.arch.warp_idx()` (a full-mask `shfl.sync.idx`) inside `if lane == 0:`, before the CTA
barrier: every launch of it hangs on an H200.
"""

from pathlib import Path

from .ptx_lint import divergent_collectives, lint, parse_body, required_threads

HUNG = (Path(__file__).parent / "data" / "hung_add_rmsnorm_bf16_h1024.ptx").read_text()


def _entry(body: str, reqntid: int = 128) -> str:
    return (
        ".version 8.0\n.target sm_90a\n.address_size 64\n"
        ".visible .entry k(\n\t.param .u32 k_param_0\n)\n"
        f".reqntid {reqntid}, 1, 1\n{{\n{body}\n}}\n"
    )


def test_the_kernel_that_hung_is_reported():
    found = divergent_collectives(HUNG)
    assert len(found) == 1 and found[0].startswith("shfl.sync.idx")
    # the warp-reduction shuffles and the barrier outside the lane-0 branch are not reported
    assert HUNG.count("shfl.sync.bfly") == 5 and "bar.sync" in HUNG


def test_block_size_mismatch_is_reported():
    assert required_threads(HUNG) == 128
    assert lint(HUNG, 128) != [] and any(".reqntid is 128" in p for p in lint(HUNG, 256))


def test_barrier_under_a_thread_dependent_branch():
    ptx = _entry(
        "\tmov.u32 %r1, %tid.x;\n\tsetp.ne.s32 %p1, %r1, 0;\n\t@%p1 bra $L__BB0_2;\n"
        "\tbar.sync 0;\n$L__BB0_2:\n\tret;"
    )
    assert divergent_collectives(ptx) == ["bar.sync 0"]


def test_barrier_under_a_block_uniform_branch_is_fine():
    ptx = _entry(
        "\tld.param.u32 %r2, [k_param_0];\n\tmov.u32 %r1, %ctaid.x;\n\tsetp.ge.s32 %p1, %r1, %r2;\n"
        "\t@%p1 bra $L__BB0_2;\n\tbar.sync 0;\n$L__BB0_2:\n\tret;"
    )
    assert lint(ptx, 128) == []


def test_loop_with_thread_dependent_trip_count_around_a_barrier():
    ptx = _entry(
        "\tmov.u32 %r1, %tid.x;\n\tmov.u32 %r3, 0;\n$L__BB0_1:\n\tbar.sync 0;\n"
        "\tadd.s32 %r3, %r3, 1;\n\tsetp.lt.s32 %p1, %r3, %r1;\n\t@%p1 bra $L__BB0_1;\n\tret;"
    )
    assert divergent_collectives(ptx) == ["bar.sync 0"]


def test_divergence_flows_through_registers_and_predicated_moves():
    # r4 is set only by lanes where p1 holds, so a branch on it diverges too
    ptx = _entry(
        "\tmov.u32 %r1, %laneid;\n\tsetp.eq.s32 %p1, %r1, 0;\n\tmov.u32 %r4, 0;\n\t@%p1 mov.u32 %r4, 1;\n"
        "\tsetp.ne.s32 %p2, %r4, 0;\n\t@%p2 bra $L__BB0_2;\n\tshfl.sync.bfly.b32 %r5, %r4, 1, 31, -1;\n$L__BB0_2:\n\tret;"
    )
    assert divergent_collectives(ptx) == ["shfl.sync.bfly.b32 %r5, %r4, 1, 31, -1"]


def test_named_barrier_count_must_be_whole_warps_within_the_block():
    ptx = _entry("\tbar.sync 1, 100;\n\tret;")
    assert any("100" in p for p in lint(ptx, 128))
    assert lint(_entry("\tbar.sync 1, 64;\n\tret;"), 128) == []


def test_parse_reads_vector_destinations_and_labels():
    instructions, labels = parse_body(HUNG)
    loads = [i for i in instructions if i.opcode == "ld.global.v4.b32"]
    assert loads and len(loads[0].dests) == 4 and loads[0].sources
    assert all(i.label in labels for i in instructions if i.opcode.startswith("bra"))
