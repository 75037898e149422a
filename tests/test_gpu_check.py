"""scripts/gpu_check.py's parts on CPU devices (the script runs on GPU nodes; this keeps its
batch construction and error checks from rotting between GPU sessions)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("rows,seq_len,seed", [(1, 4096, 0), (4, 1024, 1), (3, 32768, 2)])
def test_packed_rows_fill_every_row_with_whole_documents(rows, seq_len, seed):
    seg, pos, pairs = gpu_check._packed_rows(np.random.default_rng(seed), rows, seq_len)
    assert seg.shape == pos.shape == (rows, seq_len)
    assert (seg > 0).all()  # no padding: each row is filled to its end
    want = 0
    for r in range(rows):
        starts = np.flatnonzero(np.diff(seg[r], prepend=0))
        assert (np.diff(seg[r][starts]) == 1).all()  # documents numbered 1, 2, ... in order
        for a, b in zip(starts, [*starts[1:], seq_len]):
            assert (pos[r, a:b] == np.arange(b - a)).all()
            want += (b - a) * (b - a + 1) // 2
    assert pairs == want


def test_attention_part_checks_the_kernel_against_the_float32_reference(monkeypatch):
    monkeypatch.setattr(gpu_check, "LAYOUTS", {"tiny": [48, 20, 7, 1]})
    rows = {r["implementation"]: r for r in gpu_check.attention_part(4, 2, 32, np.dtype("bfloat16"))}
    bf16, f32 = rows["varlen"], rows["varlen-f32"]
    assert bf16["nonfinite"] == f32["nonfinite"] == 0
    for part in ("out", "dq", "dk", "dv"):
        assert 1e-4 < bf16[f"err_{part}"] < 1e-2  # bf16 rounding, not an exact copy of the reference
        assert f32[f"err_{part}"] < 1e-5
    assert "fwd_s" in bf16 and "fwd_bwd_s" in bf16
