"""The occupancy arithmetic (no GPU, no cutlass): CTAs an SM by registers, threads, shared memory."""

import pytest

from .occupancy import SM90, KernelOccupancy, ctas_per_sm


@pytest.mark.parametrize(
    "registers, threads, shared, want",
    [
        (100, 128, 32, 4),  # the default kernel at H=4096: 104 a thread, 13 blocks of 256 a warp
        (86, 128, 32, 5),  # gamma read late: 88 a thread
        (64, 128, 16 * 1024 + 32, 8),  # the re-read kernel capped for 8
        (124, 128, 32 * 1024 + 32, 4),  # FlashInfer 0.7.2's CuTe DSL kernel at H=4096 (2 rows a CTA)
        (32, 128, 48 * 1024, 4),  # shared memory bounds: 228 KiB / (48 + 1) KiB
        (16, 1024, 0, 2),  # threads bound
        (16, 32, 0, 32),  # the CTA limit
    ],
)
def test_ctas_per_sm(registers, threads, shared, want):
    assert ctas_per_sm(registers, threads, shared) == want


def test_waves_count_rows_against_the_resident_ones():
    occ = KernelOccupancy("k", registers=100, local_bytes=0, cta_threads=128, rows_per_cta=1, shared_bytes=32, ctas_per_sm=4)
    assert occ.rows_per_sm == 4 and occ.waves(4 * SM90.sms) == 1.0
