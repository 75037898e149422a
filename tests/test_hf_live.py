"""Marker hf_live: transformers itself loads what jvarlen exports (parameters moved away from the
fixture's, float32) and computes the logits jvarlen computes. Runs when a Python with torch and
transformers is at hand: this one (the hf-verify extra), or the one named by JVARLEN_HF_PYTHON
(e.g. a separate venv); skipped otherwise."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hf_helpers import MODELS, fixture, forward, imported_params, model_config, packed_row, reference
from test_hf_export import _perturbed

from jvarlen.hf.export import write_hf

pytestmark = pytest.mark.hf_live
SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "hf_logits.py"


def _python() -> str:
    if os.environ.get("JVARLEN_HF_PYTHON"):
        return os.environ["JVARLEN_HF_PYTHON"]
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    pytest.skip("needs torch and transformers (pip install -e '.[hf-verify]', or set JVARLEN_HF_PYTHON)")


@pytest.mark.parametrize("name", MODELS)
def test_transformers_loads_the_export_and_agrees(tmp_path, name):
    python = _python()
    cfg = model_config(fixture(name))
    graphdef, params = imported_params(fixture(name), cfg)
    params = _perturbed(params, seed=5)
    write_hf(params, dataclasses.replace(cfg, init_from=None), str(tmp_path / "out"), "float32")
    ref = reference(name)
    np.savez(tmp_path / "tokens.npz", tokens=ref["tokens"], offsets=ref["offsets"])
    proc = subprocess.run(
        [python, str(SCRIPT), str(tmp_path / "out"), str(tmp_path / "tokens.npz"), str(tmp_path / "logits.npy")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits, _ = forward(graphdef, params, packed_row(ref))
    np.testing.assert_allclose(logits, np.load(tmp_path / "logits.npy"), rtol=1e-4, atol=1e-5)
