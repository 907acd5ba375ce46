"""A random-weight checkpoint folder that the Triton models can serve.

The served models need a tokenizer.json, which `random:<size>` checkpoints
lack. This writes the same seeded weights in Hugging Face format with a
word-level tokenizer that spells token i as "<i>": transcripts are
meaningless, as they are for random weights anyway, but every model of the
ensemble loads and every request runs the full path.
"""

from __future__ import annotations

from pathlib import Path

from python_backend_lib.checkpoints.hf_folder import write_hf_folder
from python_backend_lib.checkpoints.weights import load_checkpoint


def write_served_checkpoint(source: str, directory: Path) -> Path:
    """source: "random:<size>[:<seed>]"; returns the folder to pass to --checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    checkpoint = load_checkpoint(source)
    write_hf_folder(checkpoint.config, checkpoint.state_dict, directory)
    n_vocab = checkpoint.config.dims.n_vocab
    tokenizer = Tokenizer(WordLevel({f"<{i}>": i for i in range(n_vocab)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
