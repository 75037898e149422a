"""What a deviceless compile's report reads from the scheduled HLO (no CUDA plugin needed)."""

from jvarlen.gpu_aot import CompileReport

HLO = """
%body (p: (bf16[8])) -> bf16[16] {
  %a = bf16[8]{0} parameter(0)
  %all-gather-start.1 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), replica_groups={{0,1}}
  %all-gather-done.1 = bf16[16]{0} all-gather-done(%all-gather-start.1)
  %all-gather-start.2 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), replica_groups={{0,1}}
  %gemm = (bf16[16]{0}, s8[0]{0}) custom-call(%all-gather-done.1), custom_call_target="__cublas$gemm"
  %all-gather-done.2 = bf16[16]{0} all-gather-done(%all-gather-start.2)
  %all-gather-start.3 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), replica_groups={{0,1}}
  %f = bf16[16]{0} fusion(%all-gather-done.2), kind=kLoop, calls=%fused
  %all-gather-done.3 = bf16[16]{0} all-gather-done(%all-gather-start.3)
  %c = bf16[16]{0} conditional(%p, %f), branch_computations={%b0, %b1}
  %reduce-scatter-start.1 = ((bf16[16]{0}), bf16[8]{0}) reduce-scatter-start(%f), replica_groups={{0,1}}
  %gemm.2 = (bf16[16]{0}, s8[0]{0}) custom-call(%f), custom_call_target="__cublas$gemm"
  %reduce-scatter-done.1 = bf16[8]{0} reduce-scatter-done(%reduce-scatter-start.1)
}
"""


def test_overlapped_counts_pairs_with_a_kernel_between():
    # pair 1: nothing between; pair 2: a cuBLAS call; pair 3: only an elementwise fusion
    assert CompileReport({}, [], HLO).overlapped() == (1, 3)
    # each collective is counted apart: the reduce-scatter has a cuBLAS call between
    assert CompileReport({}, [], HLO).overlapped("reduce-scatter") == (1, 1)
    assert CompileReport({}, [], HLO).overlapped("all-to-all") == (0, 0)


ENTRY = """
ENTRY %main (x: bf16[8]) -> bf16[16] {
  %x = bf16[8]{0} parameter(0)
  %all-gather-start.9 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%x), replica_groups={{0,1}}
  %w0 = (bf16[16]{0}) while(%t), condition=%cond, body=%other
  %all-gather-done.9 = bf16[16]{0} all-gather-done(%all-gather-start.9)
  %w = (bf16[8]{0}) while(%t), condition=%cond, body=%body
}
"""


def test_overlapped_in_loop_bodies_only():
    # the entry's pair has a loop between (counted in all, not in loops), the body's as above
    report = CompileReport({}, [], HLO + ENTRY)
    assert report.overlapped() == (2, 4)
    assert report.overlapped(loops_only=True) == (1, 3)


def test_spills_ptxas_did_not_count_are_unknown_not_zero():
    """Without ptxas (or with output it could not read) a kernel's spills are unknown: the report
    says None, so a check of ``spill_bytes == 0`` fails instead of passing on nothing (before: 0)."""
    from jvarlen.gpu_aot import KernelStats

    counted = [KernelStats("varlen_flash_fwd", 1024, 128, 0, 0), KernelStats("varlen_flash_dkv", 1024, 255, 64, 64)]
    assert CompileReport({}, counted, "").spill_bytes == 64
    uncounted = [*counted, KernelStats("varlen_flash_dq", 1024)]
    assert CompileReport({}, uncounted, "").spill_bytes is None
