"""Builds the Hugging Face fixtures of tests/test_hf_*.py with transformers itself (run once, by
hand, not in CI; needs the hf-verify extra: torch and transformers).

    pip install -e '.[hf-verify]'    # or a separate venv with torch==2.13.0 transformers
    python scripts/make_hf_fixtures.py --out tests/fixtures/hf

For each tiny model (a Llama with llama3 RoPE scaling and untied embeddings; a Qwen2 with q/k/v
biases, linear RoPE scaling and tied embeddings) it writes ``<out>/<name>/``: the model as
``save_pretrained`` writes it (config.json, model.safetensors in float32), a WordLevel
``tokenizer.json`` (ids 0-3 = <unk> <s> </s> <pad>, then words w4 ... w{V-1}) and
``reference.npz``: three documents of token ids, each ``[<s>] + body + [</s>]`` as jvarlen's
corpus stores a document, run through transformers one document at a time (the packed batch done
as separate sequences), with the float32 logits of every position, each document's loss sum and
target count (next-token cross-entropy over its own tokens) and transformers' own mean loss from
``labels=input_ids``. This script does not import jvarlen: the fixtures are transformers' numbers.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
DOC_LENGTHS = (37, 20, 11)  # tokens per document, <s> and </s> included

MODELS = {
    "tiny-llama": dict(
        cls="LlamaForCausalLM",
        config=dict(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            # the three llama3 regimes on head_dim 16, theta 1e4: wavelengths 6.3 (< 64/4, kept),
            # 19.9 and 62.8 (blended), 199 ... 19869 (> 64/1, divided by 8)
            rope_theta=10_000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        ),
        seed=0,
    ),
    "tiny-qwen2": dict(
        cls="Qwen2ForCausalLM",
        config=dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_theta=1_000_000.0,
            rope_scaling=dict(rope_type="linear", factor=2.0),
            use_sliding_window=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        ),
        seed=1,
    ),
}


def build(name: str, spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    config_cls = getattr(transformers, spec["cls"].replace("ForCausalLM", "Config"))
    config = config_cls(**spec["config"])
    config.architectures = [spec["cls"]]
    model = getattr(transformers, spec["cls"])._from_config(config, attn_implementation="eager")
    # Larger weights than transformers' 0.02 init so that logits are far from uniform and every
    # tensor (norm scales and biases included) moves them: a mapping mistake cannot hide.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in pname else 1.0) / p.shape[-1] ** 0.5)
    return model.float().eval()


def tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return tok


def reference(model, vocab_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[1], rng.integers(len(SPECIALS), vocab_size, n - 2), [2]]) for n in DOC_LENGTHS]
    logits, loss_sum, count, hf_loss = [], [], [], []
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor(doc[None], dtype=torch.long)
            out = model(input_ids=ids, labels=ids)
            lg = out.logits[0].float()
            nll = torch.nn.functional.cross_entropy(lg[:-1].double(), ids[0, 1:], reduction="sum")
            logits.append(lg.numpy())
            loss_sum.append(float(nll))
            count.append(len(doc) - 1)
            hf_loss.append(float(out.loss))
    return {
        "tokens": np.concatenate(docs).astype(np.int32),
        "offsets": np.cumsum([0, *DOC_LENGTHS]).astype(np.int64),
        "logits": np.concatenate(logits).astype(np.float32),
        "loss_sum": np.asarray(loss_sum, np.float64),
        "target_count": np.asarray(count, np.int64),
        "hf_loss": np.asarray(hf_loss, np.float64),
        "loss": np.asarray(sum(loss_sum) / sum(count), np.float64),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/hf")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name, spec in MODELS.items():
        directory = os.path.join(args.out, name)
        os.makedirs(directory, exist_ok=True)
        model = build(name, spec)
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer(spec["config"]["vocab_size"]).save(os.path.join(directory, "tokenizer.json"))
        ref = reference(model, spec["config"]["vocab_size"], spec["seed"])
        np.savez_compressed(os.path.join(directory, "reference.npz"), **ref)
        with open(os.path.join(directory, "versions.json"), "w") as f:
            json.dump(versions, f)
        print(f"{name}: loss {float(ref['loss']):.6f}, per document {ref['hf_loss'].round(6).tolist()} -> {directory}")


if __name__ == "__main__":
    main()
