"""The research API (jvarlen.api): the README's example runs verbatim and trains one step."""

from __future__ import annotations

import contextlib
import io
import os
import re

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example() -> str:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("## Using jvarlen from Python") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_verbatim(corpus_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", os.environ.get("HOME", "/root"))
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_example(), "README.md", "exec"), namespace)  # noqa: S102
    loss = namespace["metrics"]["loss_sum"] / namespace["metrics"]["target_tokens"]
    assert np.isfinite(float(loss)) and 4.0 < float(loss) < 7.0  # ~ln(320) for an untrained model
    assert int(namespace["state"].step) == 1 and float(namespace["metrics"]["grad_norm"]) > 0
    assert str(float(loss))[:5] in out.getvalue()
    # the state stays in its canonical sharding; the batch went over all devices
    session = namespace["session"]
    for leaf, sharding in zip(jax.tree.leaves(namespace["state"]), jax.tree.leaves(session.state_sharding)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert len(namespace["step"].batch_shardings(namespace["batch"])["tokens"].device_set) == jax.device_count()


def test_a_sessions_steps_keep_the_configs_residual_policy():
    """``Session.from_config``'s steps keep the residuals of ``parallel.residual_policy`` unless a
    step names its own (before: always dots_and_attention, the config's policy silently ignored)."""
    from jvarlen.api import Session
    from jvarlen.config import parse_config
    from jvarlen.layout import Layout

    config = parse_config(["--parallel.residual_policy=all", "--model.num_layers=2"])
    session = Session.from_config(config, devices=jax.devices()[:2])
    assert session.layout_step(Layout(dp=2), rows=2, seq_len=64).strategy.residual is None  # "all"
    assert session.plan_step(Layout(1, 2, 1)).strategy.residual is None
    assert session.strategy_step().strategy.residual is None
    named = session.layout_step(Layout(dp=2), rows=2, seq_len=64, residual_policy="dots_and_attention")
    assert named.strategy.residual == "dots_and_attention"
    assert Session.from_config(parse_config(["--model.num_layers=2"]), devices=jax.devices()[:2]).residual_policy == (
        "dots_and_attention"
    )
