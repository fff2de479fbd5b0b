"""moekit._sass: the tuner and the sm_90 compile check tell spills inside a loop from spills around it."""

from moekit.tools import _sass

# nvdisasm's shape: addressed instructions, labels on their own lines, branches naming a label
AROUND = """
        /*0000*/                   STL [R1], R20 ;
.L_x_3:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0030*/              @!P0 BRA `(.L_x_3) ;
        /*0040*/                   LDL.LU R20, [R1] ;
        /*0050*/                   EXIT ;
"""
INSIDE = AROUND.replace("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "STL [R1+0x8], R30")
FORWARD_ONLY = """
        /*0000*/              @P0 BRA `(.L_x_9) ;
        /*0010*/                   STL [R1], R20 ;
.L_x_9:
        /*0020*/                   EXIT ;
"""


def test_spills_before_and_after_the_loop_do_not_count():
    assert _sass.local_memory_in_loops(AROUND) == 0


def test_a_spill_inside_the_loop_counts():
    assert _sass.local_memory_in_loops(INSIDE) == 1


def test_a_forward_branch_is_not_a_loop():
    assert _sass.local_memory_in_loops(FORWARD_ONLY) == 0


def test_a_kernel_without_a_cubin_cannot_be_told():
    assert _sass.spills_in_loops(object()) is None
