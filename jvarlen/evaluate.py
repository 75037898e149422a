"""``python -m jvarlen.evaluate --run_dir RUN_DIR [--step N] [--eval.path=FILE --eval.source=jsonl ...]``:
the loss of a run's checkpoint on documents it did not train on, without training.

The run's ``config.json`` gives the data and evaluation settings. The checkpoint gives the model,
so a run started from a Hugging Face directory needs that directory no more. Any training flag
overrides them, as ``python -m jvarlen.train`` takes it. What is evaluated:

- the documents the run held out (its own ``eval.documents``; another count would take in
  documents it trained on, and is refused, as is a corpus that changed since the checkpoint), or
- a validation corpus, ``--eval.path`` (with ``--eval.source`` and ``--eval.max_documents``).

It prints the evaluation's line and then one JSON object: ``step``, ``eval_loss``,
``eval_tokens``, ``eval_batches``, ``eval_s``. Nothing is written to the run directory, so a run
that is still training there is not disturbed. One process; the devices it sees
(docs/design/evaluation.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvarlen.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", required=True, help="a jvarlen run directory (config.json, checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step; default the newest")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    from jvarlen.config import ConfigError
    from jvarlen.data import DataError

    try:
        result = evaluate_run(args.run_dir, args.step, overrides)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as error:
        print(f"jvarlen.evaluate: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


def evaluate_run(run_dir: str, step: Optional[int] = None, overrides: tuple = (), say=print) -> dict:
    """The evaluation of ``run_dir``'s checkpoint (the newest, or ``step``): the record's ``eval_*``
    fields and the step. ``overrides``: training flags (``--eval.path=...``)."""
    import jax
    import numpy as np

    from jvarlen.config import ConfigError
    from jvarlen.data import DataPipeline
    from jvarlen.hf.export import restore_params
    from jvarlen.parallel.sharding import Placement, place_global
    from jvarlen.runtime.checkpoint import abstract_like
    from jvarlen.runtime.compile_cache import CompileCache
    from jvarlen.runtime.evaluate import Evaluator
    from jvarlen.runtime.run import open_eval_corpus
    from jvarlen.runtime.state import abstract_train_state, train_state_around
    from jvarlen.runtime.strategy import StepContext

    saved = restore_params(run_dir, step)
    trained, config = _configs(run_dir, saved.model, overrides)
    if not config.eval.enabled:
        raise ConfigError(
            f"{run_dir} held out no documents (eval.documents=0): give a validation corpus, --eval.path=FILE "
            "with --eval.source"
        )
    if config.eval.documents and config.eval.documents != trained.eval.documents:
        raise ConfigError(
            f"eval.documents={config.eval.documents}, but the run held out {trained.eval.documents}: other documents "
            "would include ones it trained on; leave eval.documents as the run's, or give --eval.path"
        )
    pipeline = eval_pipeline = None
    if config.eval.documents:
        pipeline = DataPipeline(
            config.data, vocab_size=config.model.vocab_size, say=say, held_out=config.eval.documents
        )
        held = (saved.data or {}).get("fingerprint")
        if held is not None and held != pipeline.fingerprint():
            raise ConfigError(
                f"the corpus is not the one checkpoint {saved.step} trained on (its data fingerprint differs: a file "
                "edited, added or removed, another tokenizer or data.max_doc_tokens), so the held-out documents "
                "may not be the run's; restore the data, or give --eval.path"
            )
    else:
        eval_pipeline = open_eval_corpus(config, say)

    # the checkpoint's parameters straight into their canonical shards: no fresh model is built,
    # and the optimizer moments the step's signature takes are zeros made in place
    graphdef, optimizer, abstract = abstract_train_state(config)
    placement = Placement.for_state(abstract, optimizer)
    cast = jax.tree.map(lambda a, x: np.asarray(x).astype(a.dtype), abstract.params, saved.params)
    params = place_global(cast, placement.state_sharding.params)
    state = train_state_around(config, optimizer, params, placement.state_sharding)
    ctx = StepContext(graphdef, config.model, optimizer, placement, abstract_like(state))
    evaluator = Evaluator.from_config(config, pipeline, eval_pipeline, ctx, None, say)
    cache = CompileCache(say=say)
    try:
        return {"step": saved.step, **evaluator.evaluate(state, cache, saved.step)}
    finally:
        cache.close()


def _configs(run_dir: str, model, overrides) -> tuple:
    """(the run's configuration, the one to evaluate with: the run's and ``overrides``), both with the
    checkpoint's ``model`` (no ``init_from`` to read again). An ``--eval.path`` replaces the run's
    held-out documents; ``parallel.sp`` where it does not divide this machine's devices is brought
    to 1 (the run may have trained on more of them)."""
    import jax

    from jvarlen.config import parse_config

    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir!r} has no config.json: not a jvarlen run directory")
    with open(path, encoding="utf-8") as f:
        settings = json.load(f)
    settings["model"] = dataclasses.asdict(model)
    with tempfile.TemporaryDirectory() as tmp:
        merged = os.path.join(tmp, "config.json")
        with open(merged, "w", encoding="utf-8") as f:
            json.dump(settings, f)
        trained = parse_config(["--config", merged])
        if any(arg.startswith("--eval.path") for arg in overrides):  # instead of the run's held-out documents
            overrides = ["--eval.documents=0", *overrides]
        config = parse_config(["--config", merged, *overrides])
    devices = jax.device_count()
    if devices % config.parallel.sp:
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, sp=1))
    return trained, config


if __name__ == "__main__":
    sys.exit(main())
