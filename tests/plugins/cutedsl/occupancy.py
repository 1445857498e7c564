"""How many rows of an add + RMSNorm kernel an H100/H200 SM holds at once, read off the sm_90a
cubin on any machine (no GPU): the registers ptxas gave a thread, the CTA's threads and shared
memory, hence CTAs an SM, rows an SM and the waves a token count takes (test support:
test_occupancy_cpu.py, test_compile_cpu.py).

At T=1024 H=4096 a replayed call's 16 MiB stay in L2, so the time is set by how much each SM
keeps in flight and by how many waves of CTAs run one after the other: residency is what the
band kernels of `tiling.ROWS_BANDS` buy (docs/kernels.md).
"""

from __future__ import annotations

import math
import pathlib
import struct
import tempfile
from dataclasses import dataclass

import torch

from layer_boundary_cutedsl.kernels.tiling import AddNormVariant, parse_candidate

__all__ = ["SM90", "cubin_kernel_attributes", "cubin_registers", "ctas_per_sm", "KernelOccupancy", "add_norm_occupancy"]


@dataclass(frozen=True)
class SmLimits:
    """An SM's resources as the occupancy calculator counts them (compute capability 9.0)."""

    registers: int = 65536
    threads: int = 2048
    ctas: int = 32
    shared_bytes: int = 228 * 1024
    shared_reserved_per_cta: int = 1024  # the system's share of each CTA's shared memory
    register_unit: int = 256  # registers are handed to a warp in blocks of this many
    sms: int = 132  # H100 SXM and H200


SM90 = SmLimits()

_NV_INFO_SIZED = 4  # EIFMT_SVAL: a record with a 16-bit size and a payload
EIATTR_REGCOUNT = 0x2F  # registers a thread
EIATTR_FRAME_SIZE = 0x11  # bytes of local memory a thread (spilled registers, local arrays)


def cubin_kernel_attributes(cubin: bytes, attribute: int) -> dict:
    """{kernel symbol index: value} of one per-kernel attribute (EIATTR_REGCOUNT, ...) from a
    cubin's `.nv.info` section, whose records are (format, attribute, [size, payload]); a
    per-kernel attribute's payload is (symbol, value)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    values = {}
    for name_off, _type, _flags, _addr, offset, size in sections:
        name = cubin[names_at + name_off : cubin.index(b"\0", names_at + name_off)]
        if name != b".nv.info":
            continue
        pos, end = offset, offset + size
        while pos < end:
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt == _NV_INFO_SIZED:
                length = struct.unpack_from("<H", cubin, pos + 2)[0]
                if attr == attribute and length == 8:
                    symbol, value = struct.unpack_from("<II", cubin, pos + 4)
                    values[symbol] = value
                pos += 4 + length
            else:  # no value, a byte or a half-word: the record is 4 bytes
                pos += 4
    return values


def cubin_registers(cubin: bytes) -> dict:
    """{kernel symbol index: registers a thread}."""
    return cubin_kernel_attributes(cubin, EIATTR_REGCOUNT)


def ctas_per_sm(registers: int, threads: int, shared_bytes: int, sm: SmLimits = SM90) -> int:
    """CTAs of `threads` threads, `registers` a thread and `shared_bytes` of shared memory that
    fit one SM at once (the least of the register, thread, shared-memory and CTA limits)."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(registers * 32 / sm.register_unit) * sm.register_unit
    by_registers = sm.registers // (per_warp * warps)
    by_threads = sm.threads // (warps * 32)
    by_shared = sm.shared_bytes // (shared_bytes + sm.shared_reserved_per_cta)
    return min(by_registers, by_threads, by_shared, sm.ctas)


@dataclass(frozen=True)
class KernelOccupancy:
    name: str
    registers: int
    local_bytes: int  # a thread's local memory: above 0, the register cap spills
    cta_threads: int
    rows_per_cta: int
    shared_bytes: int
    ctas_per_sm: int
    sms: int = SM90.sms

    @property
    def rows_per_sm(self) -> int:
        return self.ctas_per_sm * self.rows_per_cta

    def waves(self, tokens: int) -> float:
        """How many times over the GPU's resident rows `tokens` rows are (1.0: all at once)."""
        return tokens / (self.rows_per_sm * self.sms)


def _shared_bytes(variant: AddNormVariant) -> int:
    """The kernel's shared memory: two staged rows' vectors when staged, the reduction's slots."""
    tiling = variant.tiling()
    return variant.staging_bytes + tiling.warps * tiling.rows_per_cta * 2 * 4


def add_norm_occupancy(name: str, hidden: int, dtype: torch.dtype = torch.bfloat16, sm: SmLimits = SM90) -> KernelOccupancy:
    """Compile the kernel `name` (`tiling.parse_candidate`'s names) at `hidden` for sm_90a (CPU
    is enough; needs nvidia-cutlass-dsl) and work out its occupancy from the cubin."""
    import cutlass.cute as cute

    from layer_boundary_cutedsl.kernels import compiler

    variant = AddNormVariant(dtype, hidden, **parse_candidate(name))
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(
            compiler._kernel_object(variant),
            *compiler._example_args(variant),
            options=f"--gpu-arch sm_90a --keep-cubin --dump-dir {dump}",
        )
        (cubin,) = pathlib.Path(dump).glob("*.cubin")
        image = cubin.read_bytes()
    counts = cubin_registers(image)
    if len(counts) != 1:
        raise RuntimeError(f"{name} at H={hidden}: expected one kernel's register count in the cubin, found {counts}")
    (symbol, registers), = counts.items()
    local = cubin_kernel_attributes(image, EIATTR_FRAME_SIZE).get(symbol, 0)
    tiling = variant.tiling()
    shared = _shared_bytes(variant)
    return KernelOccupancy(
        name=name,
        registers=registers,
        local_bytes=local,
        cta_threads=tiling.cta_threads,
        rows_per_cta=tiling.rows_per_cta,
        shared_bytes=shared,
        ctas_per_sm=ctas_per_sm(registers, tiling.cta_threads, shared, sm),
        sms=sm.sms,
    )
