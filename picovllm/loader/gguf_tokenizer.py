"""A GGUF's tokenizer as a transformers fast tokenizer, built from metadata already read (no second parse).

A GGUF stores its vocabulary, merges, special token ids and chat template as metadata under llama.cpp's key
names. transformers knows how to turn those into a `tokenizers` backend (normalizer, pre-tokenizer, decoder
per tokenizer model); we hand it the values our own reader took from the file. Where the installed
transformers lacks that entry point (it has moved between releases), its AutoTokenizer reads the file itself.
The result is cached with save_pretrained and loaded back with load_saved, which needs no GGUF at all.
"""
from __future__ import annotations

import os

# llama.cpp's tokenizer metadata key -> the name transformers' converter expects
_BACKEND_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


def from_metadata(meta: dict, path: str):
    """The tokenizer the GGUF at `path` describes, from its metadata `meta` (gguf_format.GGUFFile.metadata)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        from transformers import AutoTokenizer
        folder, file = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=file)
    from transformers import PreTrainedTokenizerFast

    backend_dict = {name: _plain(meta[f"tokenizer.ggml.{key}"]) for key, name in _BACKEND_KEYS.items()
                    if f"tokenizer.ggml.{key}" in meta}
    options = {"chat_template": meta.get("tokenizer.chat_template"),
               "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
               "add_eos_token": meta.get("tokenizer.ggml.add_eos_token")}
    if backend_dict.get("tokenizer_type") == "llama" and options["add_bos_token"] is None:
        options["add_bos_token"] = True       # llama.cpp's default for sentencepiece vocabularies without the flag
    tokens = backend_dict["tokens"]
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        options[name] = tokens[int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], backend_dict)
    options = {k: v for k, v in options.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **options, **extra)


def load_saved(folder: str):
    """A tokenizer that from_metadata built and save_pretrained wrote."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _plain(value):
    """numpy arrays (numeric metadata arrays) as lists, as the converter expects."""
    return value.tolist() if hasattr(value, "tolist") else value
