"""transformers' float32 logits of documents (one at a time) for a Hugging Face directory; used by
tests/test_hf_live.py with a Python that has torch and transformers (no jvarlen import).

    python scripts/hf_logits.py MODEL_DIR TOKENS.npz OUT.npy   # TOKENS.npz: tokens, offsets
"""

import sys

import numpy as np
import torch
import transformers


def main(directory: str, tokens_path: str, out_path: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    with np.load(tokens_path) as f:
        tokens, offsets = f["tokens"], f["offsets"]
    with torch.no_grad():
        logits = [
            model(input_ids=torch.tensor(tokens[a:b][None], dtype=torch.long)).logits[0].float().numpy()
            for a, b in zip(offsets[:-1], offsets[1:])
        ]
    np.save(out_path, np.concatenate(logits))


if __name__ == "__main__":
    main(*sys.argv[1:4])
