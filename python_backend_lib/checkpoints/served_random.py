"""A random-weight checkpoint folder that the Triton models can serve, and that emits text.

The served models need a tokenizer.json, which `random:<size>` checkpoints
lack: `whisper-triton serve --checkpoint random:<size>` serves the folder that
`served_random_folder` writes once into the cache, and the benchmarks write
theirs. This writes the same seeded weights (in float16, as a GPU serves them)
in Hugging Face format with a word-level tokenizer that spells token i as
"<i>": transcripts are meaningless, as they are for random weights anyway,
but every model of the ensemble loads and every request runs the full path.

Random weights mostly copy their input token, so left alone they repeat the
prompt's <|notimestamps|> and every transcript is empty. `text_only` adds
every control, language and timestamp token but <|endoftext|> to the
checkpoint's suppress_tokens: each decoded token is then a text token, the
tokenizer spells it, and the whisper model writes real text of the forced length.
transformers reads the same list from generation_config.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from python_backend_lib.checkpoints.hf_folder import write_hf_folder
from python_backend_lib.checkpoints.weights import Checkpoint, load_checkpoint
from python_backend_lib.core.cache import cache_root

FOLDER = "served-random"


def text_only(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint with every token above <|endoftext|> suppressed."""
    config = checkpoint.config
    special = set(range(config.special.eot + 1, config.dims.n_vocab))
    suppress = tuple(sorted(special | set(config.suppress_tokens)))
    return dataclasses.replace(checkpoint, config=dataclasses.replace(config, suppress_tokens=suppress))


def write_served_checkpoint(source: str, directory: Path, *, emit_text: bool = False) -> Path:
    """source: "random:<size>[:<seed>]"; returns the folder to pass to --checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    checkpoint = load_checkpoint(source)
    checkpoint = dataclasses.replace(
        checkpoint, state_dict={k: v.to(torch.float16) for k, v in checkpoint.state_dict.items()}
    )
    if emit_text:
        checkpoint = text_only(checkpoint)
    write_hf_folder(checkpoint.config, checkpoint.state_dict, directory)
    n_vocab = checkpoint.config.dims.n_vocab
    tokenizer = Tokenizer(WordLevel({f"<{i}>": i for i in range(n_vocab)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def served_random_folder(source: str, say=print) -> Path:
    """The servable folder of "random:<size>[:<seed>]" in the cache, written (with
    emit_text) the first time it is asked for: large-v3's takes a minute and 3 GB."""
    folder = cache_root() / FOLDER / source.replace(":", "-")
    if not (folder / "tokenizer.json").exists():
        say(f"writing {source} as a servable folder (its weights in float16, a tokenizer that spells token i "
            f'as "<i>") into {folder}')
        partial = folder.with_name(folder.name + ".partial")
        write_served_checkpoint(source, partial, emit_text=True)
        partial.replace(folder)
    return folder
