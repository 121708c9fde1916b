"""experiments/kernels/ncu_stalls.py on a small source page written here in ncu's CSV shape: every class of wait lands where
the module docstring says, and a file that is not such a page is refused by name."""
import csv

import pytest

from experiments.kernels import ncu_stalls

HEADER = ["Address", "Source", ncu_stalls.SAMPLES, "Instructions Executed", "stall_long_sb", "stall_barrier"]
# (SASS, samples): a prologue, the producer (arms the q tile's barrier at 0x100, waits for a free slot at 0x200),
# consumer 0 (the q tile, then a cache block at an address computed at run time, its wgmma, the other warpgroup's
# max at 0x300), consumer 1 (softmax work, its partial's write), then a retry loop after the last EXIT.
PAGE = [
    ("LDC R1, c[0x0][0x28]", 3),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x28", 0),
    ("SYNCS.ARRIVE.TRANS64 RZ, [UR40+0x100], R11", 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR40+0x200], R6", 0),
    ("@!P4  BRA 0x7f00", 10),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR40+0x100], R6", 0),
    ("@!P1  BRA 0x7f10", 4),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR23], R11", 0),
    ("@!P1  BRA 0x7f20", 8),
    ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152, gsb0", 1),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 5),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8+0x300], R14", 0),
    ("@!P1  BRA 0x7f30", 2),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 0),
    ("FFMA R3, R4, R5, R6", 6),
    ("CCTL.IVALL", 7),
    ("EXIT", 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R7+URZ+0x200], R6", 0),
    ("@!P1  BRA 0x7f40", 1),
]


def write_page(path, page=PAGE):
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "tree_verify_attention_mgpu_mosaic_gpu_kernel"])
        out.writerow(HEADER)
        for i, (sass, samples) in enumerate(page):
            out.writerow([hex(0x7000 + 16 * i), f"      {sass}", samples, 132, samples, 0])


def test_each_wait_is_classed_by_its_barrier(tmp_path):
    write_page(tmp_path / "page.csv")
    instructions = ncu_stalls.read_source_page(str(tmp_path / "page.csv"))
    assert [i["offset"] for i in instructions[:2]] == [0, 16] and instructions[4]["long_sb"] == 10
    result = ncu_stalls.breakdown(instructions)
    assert result["samples"] == sum(n for _, n in PAGE)
    assert result["warpgroups"] == {
        "prologue": {"other": 3},
        "producer": {"waits for a free slot": 10},
        "consumer 0": {"waits for a cache block": 8, "waits for its wgmma": 5, "waits for the q tile": 4,
                       "waits for the other warpgroup": 2, "issues wgmma": 1},
        "consumer 1": {"writes its partial": 7, "softmax, statistics, other": 6},
        "retries out of line": {"other": 1},
    }
    assert list(result["warpgroups"]) == ["prologue", "producer", "consumer 0", "consumer 1", "retries out of line"]
    assert result["consumers"]["waits for a cache block"] == 8 / 33
    assert sum(result["consumers"].values()) == pytest.approx(1)


def test_refuses_what_is_not_a_source_page(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n3,4\n")
    with pytest.raises(ValueError, match="not an ncu source page"):
        ncu_stalls.read_source_page(str(tmp_path / "notes.csv"))
    write_page(tmp_path / "plain.csv", [("FFMA R3, R4, R5, R6", 1), ("EXIT", 0)])
    with pytest.raises(ValueError, match="not the warp-specialized attention kernel"):
        ncu_stalls.breakdown(ncu_stalls.read_source_page(str(tmp_path / "plain.csv")))
