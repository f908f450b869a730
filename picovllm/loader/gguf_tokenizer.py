"""A GGUF's tokenizer as a transformers fast tokenizer, built from metadata already read (no second parse).

A GGUF stores its vocabulary, merges, special token ids and chat template as metadata under llama.cpp's key
names. transformers knows how to turn those into a `tokenizers` backend (normalizer, pre-tokenizer, decoder
per tokenizer model); we hand it the values our own reader took from the file. Where the installed
transformers lacks that entry point (it has moved between releases), its AutoTokenizer reads the file itself.
The result is cached with save_pretrained and loaded back with load_saved, which needs no GGUF at all.

A byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2") was learned on text split by its model's own
pre-tokenizer, which the file names only by `tokenizer.ggml.pre`. transformers' converter knows some of those
names and silently splits the rest as GPT-2 does, so a DeepSeek-V3 prompt would cut numbers wrongly. We set the
split ourselves from PRE_TOKENIZER_SPLITS (llama.cpp's regexes for each name, src/llama-vocab.cpp) and refuse a
name we do not know.

A sentencepiece vocabulary (`tokenizer.ggml.model` "llama") is split as llama.cpp splits it: spaces become "▁",
with one more "▁" before every run of text that starts the prompt or follows a special token, but only where
`tokenizer.ggml.add_space_prefix` (default true) says so. transformers 5.24's converter uses a Metaspace that adds
none before text that already starts with a space and ignores the flag (its 5.17 one did as llama.cpp does).
"""
from __future__ import annotations

import os

# Bump when from_metadata builds a different tokenizer from the same file: the artifact cache's key of a GGUF's
# converted tokenizer includes it (loader/gguf_file.py), so a tokenizer built by older code is not reused.
# 2: the BPE pre-tokenizer from PRE_TOKENIZER_SPLITS. 3: sentencepiece's space prefix as llama.cpp adds it, and
# ignore_merges for IGNORE_MERGES_PRE_TOKENIZERS. 4: the BOS of ADD_BOS_PRE_TOKENIZERS without add_bos_token.
CONVERSION_VERSION = 4

# llama.cpp's tokenizer metadata key -> the name transformers' converter expects
_BACKEND_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


# -- the BPE pre-tokenizers: llama.cpp's regex_exprs per LLAMA_VOCAB_PRE_TYPE (src/llama-vocab.cpp), applied in
# order, each splitting the pieces the one before left (matches and the text between them both kept). Where
# llama.cpp quotes the "original regex from tokenizer.json" and adapts it to std::regex, we take the original
# (the model's own; the tokenizers library runs it as written). --
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Moonshot's pattern (tokenization_kimi.py), as llama.cpp's src/unicode.cpp quotes it above its hand-written
# kimi-k2 splitter: Han runs apart, then gpt-4o's rules over the other letters.
_KIMI_UPPER, _KIMI_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = (rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}*{_KIMI_LOWER}+{_CONTRACTION}"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}+{_KIMI_LOWER}*{_CONTRACTION}"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (escapes where a letter has a canonical twin that an editor's Unicode normalization would swap in: U+1F7D,
# U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A)
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "Ὗ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳ"
    "Ꙁ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"

_DIGIT_THEN_GPT2 = (r"\p{N}", _GPT2)
_SPLITS_LLAMA3 = (_LLAMA3,)
_SPLITS_QWEN2 = (_QWEN2,)

# tokenizer.ggml.pre -> its split regexes (llama.cpp's LLAMA_VOCAB_PRE_TYPE in the comment), for the names the
# converters write for the architectures of loader/gguf_archs.py (convert_hf_to_gguf.py's get_vocab_base_pre).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # LLAMA3 (Llama 3, SmolLM3, Falcon3, Mistral's pixtral); DBRX and SMAUG (cl100k: OLMo-2, Phi-4); CHATGLM4
    # (GLM-4, GLM-4.5): llama.cpp gives all three the same regex
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0", "dbrx", "smaug-bpe",
                     "glm4", "chatglm-bpe"), _SPLITS_LLAMA3),
    # QWEN2 (Qwen2, Qwen2.5, Qwen3, DeepSeek-R1's Qwen distills)
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "f2llmv2"), _SPLITS_QWEN2),
    # STARCODER, REFACT (Granite 3), COMMAND_R (Command R, R7B, Aya), SMOLLM (SmolLM, SmolLM2), MINERVA:
    # each digit apart, then GPT-2's rules
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "minerva-7b"), _DIGIT_THEN_GPT2),
    # DEEPSEEK_LLM (DeepSeek LLM, DeepSeek-V2, -V2.5)
    "deepseek-llm": ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     _CJK_HANGUL, r"\p{N}+"),
    # DEEPSEEK_CODER (DeepSeek Coder)
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    # DEEPSEEK3_LLM (DeepSeek-V3, -R1)
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "gpt-4o": (_GPT4O,),        # GPT4O (GPT-OSS)
    "tekken": (_TEKKEN,),       # TEKKEN (Mistral NeMo, Mistral Small 3 as `llama` files)
    "kimi-k2": (_KIMI_K2,),     # KIMI_K2 (Kimi-K2, as `deepseek2` files)
    # DEFAULT: what llama.cpp splits with for "default" and for a BPE file without tokenizer.ggml.pre
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
}

# The names llama.cpp splits with GPT-2's regex alone (LLAMA_VOCAB_PRE_TYPE_GPT2, MPT, OLMO, JAIS, TRILLION,
# GRANITE_DOCLING): GPT-2's own byte-level pre-tokenizer.
GPT2_PRE_TOKENIZERS = frozenset((
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
    "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
    "granite-docling"))


# The names llama.cpp gives ignore_merges (src/llama-vocab.cpp): a pre-tokenized word that is itself a token is taken
# whole before any merge, as tiktoken does (Llama 3's and Tekken's tokenizer.json say "ignore_merges": true). Merges
# alone can miss such a token: "abcd" stays "a", "bc", "d" where "bc" merges first and "abc", "bcd" are no tokens.
IGNORE_MERGES_PRE_TOKENIZERS = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0",
                                          "tekken"))


# The names whose vocabulary llama.cpp gives a BOS where the file has no tokenizer.ggml.add_bos_token (LLAMA3's and
# TEKKEN's, src/llama-vocab.cpp; Llama 3 files of older converters have no flag); other BPE names none.
ADD_BOS_PRE_TOKENIZERS = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0", "tekken"))


def bpe_pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer of a byte-level BPE vocabulary whose tokenizer.ggml.pre is `pre` (None:
    the key is absent, which llama.cpp reads as "default"). ValueError for a name neither table has."""
    from tokenizers import Regex, pre_tokenizers
    name = "default" if pre is None else pre
    if name in GPT2_PRE_TOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is a pre-tokenizer picovllm does not read, so it cannot "
                         f"split text as the model was trained (read: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}, "
                         f"and GPT-2's: {', '.join(sorted(GPT2_PRE_TOKENIZERS))})")
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in PRE_TOKENIZER_SPLITS[name]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def from_metadata(meta: dict, path: str):
    """The tokenizer the GGUF at `path` describes, from its metadata `meta` (gguf_format.GGUFFile.metadata)."""
    bpe = meta.get("tokenizer.ggml.model") == "gpt2"
    try:
        pre_tokenizer = bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre")) if bpe else None
    except ValueError as e:
        raise ValueError(f"GGUF {path!r}: {e}") from None
    tokenizer = _converted(meta, path)
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.backend_tokenizer.model.ignore_merges = meta.get("tokenizer.ggml.pre") in IGNORE_MERGES_PRE_TOKENIZERS
    if meta.get("tokenizer.ggml.model") == "llama":
        _split_as_llama_cpp_spm(tokenizer.backend_tokenizer, meta.get("tokenizer.ggml.add_space_prefix", True))
    return tokenizer


def _split_as_llama_cpp_spm(backend, add_space_prefix: bool) -> None:
    """A sentencepiece vocabulary's normalizer and decoder as llama.cpp's SPM tokenizer works (llama_vocab::impl::
    tokenize): each run of plain text (the prompt's start, or text after a special token) gets a " " in front where
    the file says add_space_prefix, then every space becomes "▁"; nothing else splits it. The normalizer does
    both for each run between added tokens. Sentencepiece itself always prepends, so " Hi" is "▁▁Hi"
    (the converter's Metaspace gave "▁Hi"). Decoding drops the first space only where one was added."""
    from tokenizers import decoders, normalizers
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])


def _gguf_converter():
    """transformers' converter of a GGUF's tokenizer metadata, (architecture, dict) -> (backend, extra kwargs): the
    one of 5.24's layout, or the older transformers.integrations.ggml one (5.17's: a converter per architecture, so
    an architecture it does not list borrows its tokenizer model's: gpt2's byte-level BPE, llama's sentencepiece;
    the BPE split is ours either way); None where neither is there."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
        return convert_gguf_tokenizer
    except ImportError:
        pass
    try:
        from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer as by_architecture
    except ImportError:
        return None

    def convert(architecture: str, tokenizer_dict: dict):
        if architecture not in GGUF_TO_FAST_CONVERTERS:
            architecture = "gpt2" if tokenizer_dict.get("tokenizer_type") == "gpt2" else "llama"
        return by_architecture(architecture, tokenizer_dict)
    return convert


def _converted(meta: dict, path: str):
    """transformers' conversion of the file's tokenizer metadata."""
    convert_gguf_tokenizer = _gguf_converter()
    if convert_gguf_tokenizer is None:
        from transformers import AutoTokenizer
        folder, file = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=file)
    from transformers import PreTrainedTokenizerFast

    backend_dict = {name: _plain(meta[f"tokenizer.ggml.{key}"]) for key, name in _BACKEND_KEYS.items()
                    if f"tokenizer.ggml.{key}" in meta}
    options = {"chat_template": meta.get("tokenizer.chat_template"),
               "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
               "add_eos_token": meta.get("tokenizer.ggml.add_eos_token")}
    if options["add_bos_token"] is None:      # llama.cpp's default without the flag: sentencepiece's BOS, some BPE's
        options["add_bos_token"] = (backend_dict.get("tokenizer_type") == "llama"
                                    or backend_dict.get("pre_tokenizer_type") in ADD_BOS_PRE_TOKENIZERS)
    tokens = backend_dict["tokens"]
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        options[name] = tokens[int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], backend_dict)
    options = {k: v for k, v in options.items() if v is not None}
    # the file's own special tokens over the converter's (5.17's gpt2 converter names an unk_token too)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **options})


def load_saved(folder: str):
    """A tokenizer that from_metadata built and save_pretrained wrote."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _plain(value):
    """numpy arrays (numeric metadata arrays) as lists, as the converter expects."""
    return value.tolist() if hasattr(value, "tolist") else value
