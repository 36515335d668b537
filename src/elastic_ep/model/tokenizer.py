"""Loading a checkpoint's `tokenizer.json` (the `tokenizers` library, no transformers)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from elastic_ep.errors import CheckpointError


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint dir; CheckpointError if tokenizer.json is missing or unreadable."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint dir {model_dir} has no tokenizer.json; copy the model's tokenizer.json there "
            "(or pass token ids instead of text)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read as a tokenizers file ({e}); replace it") from e


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, without special tokens added."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """Text of `token_ids`, special tokens dropped."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)
