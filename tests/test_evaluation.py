"""Evaluation (eval.documents held out, or eval.path's corpus): which documents, their batches, and
the logged eval_loss against the single-device model's loss on the same documents."""

import json

import jax
import numpy as np
import pytest
from conftest import values_compile
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_flags import REFERENCE_ATTENTION, TINY_MODEL_ARGS

from jvarlen.config import ConfigError, parse_config
from jvarlen.data import DataPipeline, SamplerStateError
from jvarlen.data.held_out import held_out_documents, pack_all
from jvarlen.data.packer import pack
from jvarlen.runtime.loop import train
from jvarlen.runtime.state import create_train_state
from jvarlen.runtime.step import BATCH_KEYS, loss_sums

TINY_ARGS = [
    *TINY_MODEL_ARGS,
    REFERENCE_ATTENTION,
    "--data.seq_len=128",
    "--data.tokens_per_batch=512",
    "--data.max_documents=40",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--train.cost_profile=none",
    "--checkpoint.every_steps=10",
]


def _config(tmp_path, cache, *extra):
    return parse_config([*TINY_ARGS, f"--data.cache_dir={cache}", f"--logging.run_dir={tmp_path / 'run'}", *extra])


def test_held_out_documents_are_whole_fixed_by_count_and_never_trained(tmp_path):
    cache = tmp_path / "corpus"
    data = _config(tmp_path, cache).data
    plain = DataPipeline(data)
    held = DataPipeline(data, held_out=5)
    other_seed = DataPipeline(_config(tmp_path, cache, "--data.seed=7").data, held_out=5)

    docs = held.held_out
    assert len(set(docs.tolist())) == 5 and list(docs) == sorted(docs)
    np.testing.assert_array_equal(docs, other_seed.held_out)  # not data.seed's
    assert not np.isin(held.pieces.doc, docs).any()  # training never draws a held-out piece
    assert set(held.eval_pieces.doc.tolist()) == set(docs.tolist())
    # whole documents: every held-out token is in the pieces, and no training document lost one
    assert held.eval_pieces.length.sum() == held.corpus.lengths[docs].sum()
    assert held.pieces.length.sum() + held.eval_pieces.length.sum() == plain.pieces.length.sum()
    # eval batches: every held-out piece once, rows within seq_len
    seen = []
    for pieces, rows in held.eval_batches():
        batch = pack(pieces, data.rows_per_batch, data.seq_len, rows)
        assert batch.tokens.shape == (data.rows_per_batch, data.seq_len)
        seen += [(p.doc_id, len(p.tokens)) for p in pieces]
    expected = [(int(d), int(n)) for d, n in zip(held.eval_pieces.doc, held.eval_pieces.length)]
    assert sorted(seen) == sorted(expected)
    # none held out: the training data (and so a checkpoint's fingerprint) is the run's without eval
    assert DataPipeline(data, held_out=0).fingerprint() == plain.fingerprint()
    assert held.fingerprint() != plain.fingerprint()
    assert "5 documents" in held.summary() and "held out for evaluation" in held.summary()


def test_a_resume_with_another_held_out_count_is_refused_by_name(tmp_path):
    data = _config(tmp_path, tmp_path / "corpus").data
    saved = DataPipeline(data, held_out=3)
    saved.next_batch()
    with pytest.raises(SamplerStateError, match="eval.documents=3, this run has 4"):
        DataPipeline(data, held_out=4).restore(saved.state())
    resumed = DataPipeline(data, held_out=3)
    resumed.restore(saved.state())
    np.testing.assert_array_equal(resumed.next_batch().tokens, saved.next_batch().tokens)


def test_bad_evaluation_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="eval.documents=2 and eval.path='v.jsonl' both choose"):
        _config(tmp_path, tmp_path / "corpus", "--eval.documents=2", "--eval.path=v.jsonl", "--eval.source=jsonl")
    with pytest.raises(ConfigError, match="eval.source describe eval.path, which is not set"):
        _config(tmp_path, tmp_path / "corpus", "--eval.source=jsonl")
    with pytest.raises(ConfigError, match="set eval.source to jsonl, text_dir or parquet"):
        _config(tmp_path, tmp_path / "corpus", "--eval.path=v.jsonl")
    from jvarlen.data import DataError
    from jvarlen.runtime.run import open_eval_corpus

    missing = _config(tmp_path, tmp_path / "corpus", f"--eval.path={tmp_path / 'none.jsonl'}", "--eval.source=jsonl")
    with pytest.raises(DataError, match=r"^eval.path '.*none.jsonl': "):  # its corpus named, not data.path's
        open_eval_corpus(missing, print)
    for bad in ("[64,16]", "[0,16]", "[]"):
        with pytest.raises(ConfigError, match="eval.position_bins must be increasing positive positions"):
            _config(tmp_path, tmp_path / "corpus", f"--eval.position_bins={bad}")
    with pytest.raises(ConfigError, match="eval.documents must be >= 0"):
        _config(tmp_path, tmp_path / "corpus", "--eval.documents=-1")
    with pytest.raises(ConfigError, match="eval.every_steps must be > 0"):
        _config(tmp_path, tmp_path / "corpus", "--eval.every_steps=0")
    with pytest.raises(ConfigError, match="eval.documents=40 must be below the corpus' 40 documents"):
        DataPipeline(_config(tmp_path, tmp_path / "corpus").data, held_out=40)
    with pytest.raises(ValueError, match="at least one is needed for training"):
        held_out_documents(1, 1)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=40),
    rows=st.integers(1, 4),
    seq_len=st.integers(64, 100),
)
def test_pack_all_places_every_item_once_within_its_rows(lengths, rows, seq_len):
    batches = pack_all(np.asarray(lengths, np.int64), rows, seq_len)
    items = np.concatenate([b[0] for b in batches]) if batches else np.zeros(0, np.int64)
    assert sorted(items.tolist()) == list(range(len(lengths)))
    for index, row_of in batches:
        assert len(index) > 0 and row_of.min() >= 0 and row_of.max() < rows
        fill = np.bincount(row_of, weights=np.asarray(lengths)[index], minlength=rows)
        assert fill.max() <= seq_len


def _reference_eval_loss(config, params, edges=()) -> tuple:
    """Σ loss / Σ targets of the evaluated documents (held out, or eval.path's) by the single-device
    model (no layout, no pull), packed into ``data.rows_per_batch`` rows: the loss of a document does
    not depend on its row. With ``edges``, also that of each position bin, each from the plain loss
    with the loss mask cut to the bin's positions: (loss, targets, [loss of bin k])."""
    graphdef, _, _ = create_train_state(config)
    params = jax.device_get(params)
    if config.eval.path is None:
        batches = DataPipeline(config.data, held_out=config.eval.documents).eval_batches()
    else:
        batches = DataPipeline(config.eval.data(config.data)).eval_batches(every=True)
    sums = jax.jit(lambda p, b: loss_sums(graphdef, p, b))
    bounds = [0, *edges, np.inf]
    loss, targets = np.zeros(len(bounds)), np.zeros(len(bounds))  # [all, bin 0, bin 1, ...]
    for pieces, rows in batches:
        batch = pack(pieces, config.data.rows_per_batch, config.data.seq_len, rows)
        arrays = {k: getattr(batch, k) for k in BATCH_KEYS}
        masks = [arrays["loss_mask"]] + [
            arrays["loss_mask"] * ((batch.positions >= lo) & (batch.positions < hi))
            for lo, hi in zip(bounds, bounds[1:])
        ]
        for k, mask in enumerate(masks):
            out = jax.device_get(sums(params, {**arrays, "loss_mask": mask}))
            loss[k], targets[k] = loss[k] + float(out["loss_sum"]), targets[k] + float(out["target_tokens"])
    return loss[0] / targets[0], targets[0], [a / b for a, b in zip(loss[1:], targets[1:])]


@pytest.mark.parametrize(
    "layout, eval_rows",
    [
        # the layouts strategy: its own (dp=4, sp=2) layout, Ulysses attention; the batch's 4 rows
        (["--parallel.pp=1", "--parallel.sp=2"], 4),
        # the elastic pipeline: evaluated on (dp=8, sp=1), not on the pipeline executor; 8 rows, one
        # per device, where a batch of 4 would leave 4 devices with padding
        (["--parallel.pp=2", "--plan.wait=true"], 8),
    ],
    ids=["layouts-sp2", "pipeline-pp2"],
)
def test_eval_loss_is_the_single_device_loss_of_the_held_out_documents(
    tmp_path, layout, eval_rows, monkeypatch, capsys
):
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    config = _config(
        tmp_path,
        tmp_path / "corpus",
        *layout,
        "--train.steps=3",
        "--eval.documents=4",
        "--eval.every_steps=2",
        "--eval.position_bins=[16,64]",
    )
    monkeypatch.setattr("jvarlen.runtime.evaluate.PROGRESS_EVERY_S", -1.0)  # a progress line per batch
    result = train(config, compiler_options=values_compile())
    out = capsys.readouterr().out
    assert "step 2: evaluating, batch 1 of" in out and "step 3: eval loss" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # after step 2 (every_steps) and after the last step, 3
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    first, last = (r for r in records if "eval_loss" in r)
    expected, targets, by_position = _reference_eval_loss(config, result.final_state.params, (16, 64))
    assert last["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert last["eval_tokens"] == targets > 0 and last["eval_s"] > 0
    # by the position of the predicting token in its piece (seq_len 128: the last bin is 64-127)
    names = ["eval_loss/pos_0-15", "eval_loss/pos_16-63", "eval_loss/pos_64+"]
    assert [last[n] for n in names] == pytest.approx(by_position, rel=1e-5)
    assert len(set(by_position)) == 3
    assert last["eval_batches"] == len(DataPipeline(config.data, held_out=4).eval_batches(eval_rows))
    assert first["eval_tokens"] == targets  # the same batches every time
    assert first["eval_loss"] != last["eval_loss"]  # of the state after that step
    closing = out.split("steps 1-3: loss first")[1].splitlines()[0]
    assert f", eval loss {last['eval_loss']:.4f} after step 3;" in closing


def test_a_layout_steps_evaluate_is_its_forward_pass_and_leaves_the_state(tmp_path):
    """The research API's evaluation: the loss sums the train step reports for the state it starts
    from, with the state still usable (not donated)."""
    from jvarlen.api import Session
    from jvarlen.layout import Layout

    config = _config(tmp_path, tmp_path / "corpus")
    session = Session.from_config(config, devices=jax.devices()[:4], compiler_options=values_compile())
    step = session.layout_step(Layout(dp=2, sp=2), rows=2, seq_len=128)
    rng = np.random.default_rng(0)
    prepared = step.prepare([rng.integers(0, 256, n) for n in (100, 20, 90)])
    sums = jax.device_get(step.evaluate(session.state, prepared))
    assert sums["target_tokens"] == 100 + 20 + 90 - 3 and sums["real_tokens"] == 210
    state, metrics = step(session.state, prepared)  # the state evaluate read is still whole
    assert float(sums["loss_sum"]) == pytest.approx(float(metrics["loss_sum"]), rel=1e-6)
    after = jax.device_get(step.evaluate(state, prepared))
    assert float(after["loss_sum"]) != float(sums["loss_sum"])


def test_a_validation_corpus_of_its_own_is_evaluated_whole(tmp_path):
    """eval.path: every document of another corpus (here JSONL beside a stdlib training corpus)."""
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    rng = np.random.default_rng(3)
    texts = ["".join(chr(c) for c in rng.integers(97, 123, n)) for n in (40, 300, 90, 700, 15)]
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    config = _config(
        tmp_path,
        tmp_path / "corpus",
        "--parallel.pp=1",
        "--train.steps=2",
        f"--eval.path={path}",
        "--eval.source=jsonl",
    )
    result = train(config, quiet=True, compiler_options=values_compile())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]  # the last step only (every_steps 50)
    expected, targets, _ = _reference_eval_loss(config, result.final_state.params)
    assert records[-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    # every byte of every document, with BOS and EOS, predicted: its tokens + 1 targets each
    assert records[-1]["eval_tokens"] == targets == sum(len(t) + 1 for t in texts)


def test_an_evaluation_program_that_does_not_fit_stops_the_run_at_its_start(tmp_path, monkeypatch):
    """The evaluation compiles in the background after the first step; a refusal (here a stand-in
    for a program larger than the device) stops the run a step later, not at the first evaluation."""
    from jvarlen.runtime.memory_fit import DeviceMemoryError
    from jvarlen.runtime.strategies.layouts import LayoutStrategy

    def refuse(self, key):
        raise DeviceMemoryError("the evaluation step needs 90 GiB")

    monkeypatch.setattr(LayoutStrategy, "compile_eval", refuse)
    config = _config(tmp_path, tmp_path / "corpus", "--parallel.pp=1", "--train.steps=30", "--eval.documents=2")
    with pytest.raises(DeviceMemoryError, match="90 GiB"):
        train(config, quiet=True, compiler_options=values_compile())
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) <= 2  # eval.every_steps is 50: before, step 30's evaluation raised it


def test_a_stop_signal_abandons_the_evaluation_for_the_checkpoint(tmp_path, monkeypatch, capsys):
    """SIGTERM during an evaluation (a preemption notice, with a grace period): the evaluation stops
    before its next batch, and the step's checkpoint is written and the run stopped as on any step."""
    import os
    import signal

    from jvarlen.runtime.evaluate import Evaluator
    from jvarlen.runtime.stop import Interrupted

    prepare = Evaluator._prepare

    def prepare_then_signal(self, b):
        if b == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return prepare(self, b)

    monkeypatch.setattr(Evaluator, "_prepare", prepare_then_signal)
    config = _config(
        tmp_path,
        tmp_path / "corpus",
        "--parallel.pp=1",
        "--train.steps=4",
        "--eval.documents=4",
        "--eval.every_steps=2",
    )
    with pytest.raises(Interrupted) as stopped:
        train(config, compiler_options=values_compile())
    assert stopped.value.step == 2
    out = capsys.readouterr().out
    assert "step 2: evaluation abandoned before batch 2 of" in out and "(SIGTERM)" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "eval_loss" not in records[-1]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]


def test_a_checkpoint_is_evaluated_later_as_the_run_evaluated_it(tmp_path, capsys):
    """python -m jvarlen.evaluate: the run's own held-out documents give the loss the run logged for
    that step; a validation corpus may replace them; other held-out documents, or a corpus changed
    since, would take in trained documents and are refused."""
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    from jvarlen.evaluate import main

    config = _config(
        tmp_path, tmp_path / "corpus", "--parallel.pp=1", "--parallel.sp=2", "--train.steps=2", "--eval.documents=4"
    )
    train(config, quiet=True, compiler_options=values_compile())
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    run = f"--run_dir={tmp_path / 'run'}"
    assert main([run]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["step"] == 2 and result["eval_tokens"] == logged["eval_tokens"]
    assert result["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)

    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (30, 200)))
    assert main([run, f"--eval.path={path}", "--eval.source=jsonl"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eval_tokens"] == 31 + 201

    assert main([run, "--eval.documents=5"]) == 2
    assert "eval.documents=5, but the run held out 4" in capsys.readouterr().err
    # another piece table: the data fingerprint differs, and the held-out set cannot be vouched for
    assert main([run, "--data.max_doc_tokens=64"]) == 2
    assert "the corpus is not the one checkpoint 2 trained on" in capsys.readouterr().err
