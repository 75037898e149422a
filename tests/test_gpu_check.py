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


def test_every_recorded_failure_makes_the_check_fail():
    """A failure recorded inside a part (a step's traceback, a wrong or non-finite attention row, the
    kernel tests', main job's or a pipeline run's exit status) fails the check, one line each
    (before: only a part that raised did; a failing step left exit 0)."""
    good = {"layout": "4 × 4K", "implementation": "varlen", **{f"err_{p}": 2e-3 for p in ("out", "dq", "dk", "dv")}}
    results = {"device": {"kind": "cpu", "count": 1}, "errors": {}, "attention": [good], "step": []}
    results["tests"] = {"returncode": 0, "summary": "35 passed", "failures": []}
    results["train"] = {"returncode": 0, "wall_s": 60.0, "losses": [5.8, 5.1], "median_step_s": 0.2}
    results["pipeline"] = [{"policy": "epp", "returncode": 0}, {"skipped": "needs >= 2 GPUs for pp = 2"}]
    assert gpu_check.failures(results) == []
    results["attention"] += [{**good, "implementation": "cudnn", "err_dq": 0.4}, {**good, "nonfinite": 3}]
    results["step"] = [
        {"name": "configs/x.yaml", "error": "Traceback (most recent call last):\n  ...\nOSError: gone\n"}
    ]
    results["tests"]["returncode"], results["pipeline"][0]["returncode"] = 1, 2
    failed = gpu_check.failures(results)
    assert failed == [
        "attention 4 × 4K cudnn: relative error 4.0e-01 > 0.01",
        "attention 4 × 4K varlen: 3 non-finite values",
        "step configs/x.yaml: OSError: gone",
        "tests: exit 1",
        "pipeline epp: exit 2",
    ]
    assert "Failures: 5" in gpu_check.summary(results)
