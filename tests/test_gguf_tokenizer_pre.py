"""A byte-level BPE GGUF's pre-tokenizer (loader/gguf_tokenizer.py): the split llama.cpp uses for its
`tokenizer.ggml.pre` (src/llama-vocab.cpp), an unknown name refused.

Each oracle is worked by hand from the regexes (the comment names the rule that makes each piece); pieces are
compared as text, before the byte-level mapping (which only respells them)."""
from __future__ import annotations

import json

import gguf
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from picovllm.artifact_cache import ArtifactCache
from picovllm.loader import gguf_tokenizer
from picovllm.loader.gguf_file import open_gguf
from picovllm.loader.gguf_format import GGUFFile
from picovllm.loader.gguf_tokenizer import GPT2_PRE_TOKENIZERS, PRE_TOKENIZER_SPLITS, bpe_pre_tokenizer
from test_gguf import write_tiny_gguf

def _from_bytes(piece: str) -> str:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    back = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(back[c] for c in piece).decode("utf-8")


def pieces(pre: str | None, text: str) -> list[str]:
    return [_from_bytes(p) for p, _ in bpe_pre_tokenizer(pre).pre_tokenize_str(text)]


NUMBER, CJK, CONTRACTIONS, PUNCT, LINES = "12345", "日本語テキスト", "I'm sure they'll", "Hi!!! ...?", "a\n\n  b"

# name group -> text -> the pieces, worked by hand. Rules are quoted by their alternative in the regex.
ORACLES = {
    # GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
    "gpt-2": {
        NUMBER: ["12345"],                                    # ` ?\p{N}+`, any length
        CJK: [CJK],                                           # ` ?\p{L}+`: kanji and katakana are letters (Lo)
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],   # ` ?\p{L}+`, `'m`, `'ll`
        PUNCT: ["Hi", "!!!", " ...?"],                        # ` ?[^\s\p{L}\p{N}]+` takes the space before "..."
        LINES: ["a", "\n\n ", " b"],                          # `\s+(?!\S)` leaves the last space to ` ?\p{L}+`
        "x 12": ["x", " 12"],                                 # ` ?\p{N}+` takes its space
    },
    # STARCODER/REFACT/COMMAND_R/SMOLLM/MINERVA: `\p{N}` first, then GPT-2's regex on what is left
    "smollm": {
        NUMBER: ["1", "2", "3", "4", "5"],                    # `\p{N}`: one digit each
        CJK: [CJK],                                           # GPT-2's ` ?\p{L}+`
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],   # as GPT-2
        PUNCT: ["Hi", "!!!", " ...?"],                        # as GPT-2
        LINES: ["a", "\n\n ", " b"],                          # as GPT-2
        "x 12": ["x", " ", "1", "2"],                         # `\p{N}` cuts "x " off, GPT-2 splits "x" from " "
    },
    # LLAMA3 (and DBRX, SMAUG, CHATGLM4): (?i:'s|..)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*
    #                                     |\s*[\r\n]+|\s+(?!\S)|\s+
    "llama-bpe": {
        NUMBER: ["123", "45"],                                # `\p{N}{1,3}` from the left
        CJK: [CJK],                                           # `\p{L}+`
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],   # `'m`, `[^\r\n\p{L}\p{N}]?\p{L}+` takes the space
        PUNCT: ["Hi", "!!!", " ...?"],                        # ` ?[^\s\p{L}\p{N}]+`
        LINES: ["a", "\n\n", " ", " b"],                      # `\s*[\r\n]+` ends at the last newline; `\s+(?!\S)`
        "YOU'LL": ["YOU", "'LL"],                             # (?i:'ll): any case
    },
    # QWEN2: LLAMA3's regex with `\p{N}` for `\p{N}{1,3}`
    "qwen2": {
        NUMBER: ["1", "2", "3", "4", "5"],                    # `\p{N}`
        CJK: [CJK],
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],
        PUNCT: ["Hi", "!!!", " ...?"],
        LINES: ["a", "\n\n", " ", " b"],                      # `\s*[\r\n]+`, `\s+(?!\S)`, then ` b`
    },
    # DEEPSEEK_LLM: [\r\n] / \s?[cased letters]+ / \s?[!-/:-~！-／：-～‘-‟　-。]+ / \s+$ / [一-龥ࠀ-一가-퟿]+ / \p{N}+
    "deepseek-llm": {
        NUMBER: ["12345"],                                    # `\p{N}+`, any length
        CJK: [CJK],                                           # `[一-龥ࠀ-一...]+`: ࠀ-一 (U+0800-4E00) holds katakana
        CONTRACTIONS: ["I", "'", "m", " sure", " they", "'", "ll"],   # the letters rule leaves each "'" apart
        PUNCT: ["Hi", "!!!", " ...?"],                        # letters, then `\s?[!-/:-~...]+` on "!!! ...?"
        LINES: ["a", "\n", "\n", " ", " b"],                  # `[\r\n]` one newline each; `\s?[letters]+` " b"
        "Café": ["Caf", "é"],                                 # `:-~` holds ASCII letters: the third rule re-cuts
    },
    # DEEPSEEK_CODER: [\r\n] / \s?\p{L}+ / \s?\p{P}+ / [一-龥ࠀ-一가-퟿]+ / \p{N}
    "deepseek-coder": {
        NUMBER: ["1", "2", "3", "4", "5"],                    # `\p{N}`
        CJK: [CJK],                                           # `\s?\p{L}+`
        CONTRACTIONS: ["I", "'", "m", " sure", " they", "'", "ll"],   # `\s?\p{L}+` leaves "'", `\p{P}` keeps it
        PUNCT: ["Hi", "!!!", " ...?"],                        # `\s?\p{P}+`
        LINES: ["a", "\n", "\n", " ", " b"],                  # `[\r\n]`; `\s?\p{L}+` takes " b"
    },
    # DEEPSEEK3_LLM: \p{N}{1,3} / [一-龥぀-ゟ゠-ヿ]+ / [!"#..~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
    #                 | ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    "deepseek-v3": {
        NUMBER: ["123", "45"],                                # `\p{N}{1,3}`
        CJK: [CJK],                                           # kanji and katakana in one class
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],   # `[!"#..~][A-Za-z]+`: punctuation then letters
        PUNCT: ["Hi", "!!!", " ...?"],                        # ` ?[\p{P}\p{S}]+`
        LINES: ["a", "\n\n", " ", " b"],                      # `\s*[\r\n]+`, `\s+(?!\S)`, then ` b`
        "x 日本": ["x", " ", "日本"],                         # the CJK rule first: the space stays apart
    },
    # GPT4O: [^\r\n\p{L}\p{N}]?UPPER*LOWER+(?i:'s|..)?|[^\r\n\p{L}\p{N}]?UPPER+LOWER*(?i:'s|..)?|\p{N}{1,3}
    #        | ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
    "gpt-4o": {
        NUMBER: ["123", "45"],                                # `\p{N}{1,3}`
        CJK: [CJK],                                           # Lo is both "upper" and "lower"
        CONTRACTIONS: ["I'm", " sure", " they'll"],           # the contraction sticks to its word
        PUNCT: ["Hi", "!!!", " ...?"],
        LINES: ["a", "\n\n", " ", " b"],
        "getUserName": ["get", "User", "Name"],               # UPPER*LOWER+ cuts before each capital
    },
    # TEKKEN: GPT4O without the contractions, `\p{N}` for `\p{N}{1,3}`
    "tekken": {
        NUMBER: ["1", "2", "3", "4", "5"],
        CJK: [CJK],
        CONTRACTIONS: ["I", "'m", " sure", " they", "'ll"],   # "'" is the optional leading character of "'m"
        PUNCT: ["Hi", "!!!", " ...?"],
        LINES: ["a", "\n\n", " ", " b"],
        "getUserName": ["get", "User", "Name"],
    },
    # KIMI_K2 (Moonshot's pattern): [\p{Han}]+|GPT4O's letter rules without Han|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*
    #                               |\s*[\r\n]+|\s+(?!\S)|\s+
    "kimi-k2": {
        NUMBER: ["123", "45"],
        CJK: ["日本語", "テキスト"],                          # `[\p{Han}]+`, then katakana by the letter rules
        CONTRACTIONS: ["I'm", " sure", " they'll"],
        PUNCT: ["Hi", "!!!", " ...?"],
        LINES: ["a", "\n\n", " ", " b"],
    },
    # DEFAULT (llama.cpp's for "default" or no tokenizer.ggml.pre): [\p{P}\$\+<=>\^~\|]+ / GPT-2 / \p{N}+ /
    # [0-9][0-9][0-9]
    "default": {
        NUMBER: ["123", "45"],                                # `[0-9][0-9][0-9]`, the rest left apart
        CJK: [CJK],
        CONTRACTIONS: ["I", "'", "m", " sure", " they", "'", "ll"],   # the punctuation rule runs first
        PUNCT: ["Hi", "!!!", " ", "...?"],                    # punctuation runs apart from their space
        LINES: ["a", "\n\n ", " b"],                          # GPT-2's
    },
}

# every name of the table, by the oracle of its regex
GROUPS = {
    "gpt-2": sorted(GPT2_PRE_TOKENIZERS),
    "smollm": ["smollm", "refact", "command-r", "starcoder", "minerva-7b"],
    "llama-bpe": ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0", "dbrx", "smaug-bpe",
                  "glm4", "chatglm-bpe"],
    "qwen2": ["qwen2", "deepseek-r1-qwen", "megrez", "f2llmv2"],
    "deepseek-llm": ["deepseek-llm"], "deepseek-coder": ["deepseek-coder"], "deepseek-v3": ["deepseek-v3"],
    "gpt-4o": ["gpt-4o"], "tekken": ["tekken"], "kimi-k2": ["kimi-k2"], "default": ["default"],
}
CASES = [(name, group, text) for group, names in GROUPS.items() for name in names for text in ORACLES[group]]


def test_every_name_has_an_oracle():
    assert sorted(n for names in GROUPS.values() for n in names) == \
        sorted([*PRE_TOKENIZER_SPLITS, *GPT2_PRE_TOKENIZERS])


@pytest.mark.parametrize("name,group,text", CASES, ids=[f"{n}-{t!r}" for n, _, t in CASES])
def test_pre_tokenizer_splits_as_llama_cpp(name, group, text):
    assert pieces(name, text) == ORACLES[group][text]


def test_missing_pre_is_llama_cpps_default():
    assert pieces(None, "12345 x") == ["123", "45", " x"]


def test_gpt2_names_keep_gpt2s_own_pre_tokenizer():
    gpt2 = ByteLevel(add_prefix_space=False, use_regex=True)
    text = " ".join([NUMBER, CJK, CONTRACTIONS, PUNCT, LINES, "x 12"])
    for name in GPT2_PRE_TOKENIZERS:
        assert bpe_pre_tokenizer(name).pre_tokenize_str(text) == gpt2.pre_tokenize_str(text), name


@pytest.mark.parametrize("pre", ["superbpe", "qwen35", "llama4", "no-such-pre"])
def test_unknown_pre_is_refused_by_name(pre):
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre '{pre}'"):
        bpe_pre_tokenizer(pre)


# -- through a file --------------------------------------------------------------------------------------
_DIGITS = [*"0123456789", "12", "123", "45", "12345"]


def _write_tokenizer_gguf(path: str, pre: str, add_bos: bool | None = None) -> None:
    """A gguf-package file holding only a byte-level vocabulary: every byte, and merges that would join "12345"
    whole if nothing cut it first; tokenizer.ggml.add_bos_token only where add_bos is given."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = list(dict.fromkeys(bytes_to_unicode().values()))
    tokens = ["<s>", "</s>", *alphabet, *[t for t in _DIGITS if len(t) > 1]]
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(["1 2", "12 3", "4 5", "123 45"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_deepseek_v3_file_cuts_numbers_into_threes(tmp_path):
    path = str(tmp_path / "v3.gguf")
    _write_tokenizer_gguf(path, "deepseek-v3")
    tok = gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)
    got = tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False))
    assert got == ["123", "45"] and all(len(t) <= 3 for t in got)


def test_gpt2_file_keeps_the_number_whole(tmp_path):
    """The same vocabulary under GPT-2's split: the merges join all five digits (what the old code did for
    every name transformers did not know)."""
    path = str(tmp_path / "gpt2.gguf")
    _write_tokenizer_gguf(path, "gpt-2")
    tok = gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)
    assert tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False)) == ["12345"]


def test_unknown_pre_in_a_file_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "odd.gguf")
    _write_tokenizer_gguf(path, "no-such-pre")
    with pytest.raises(ValueError, match=r"odd\.gguf.*tokenizer\.ggml\.pre 'no-such-pre'"):
        gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS) + sorted(GPT2_PRE_TOKENIZERS))
def test_bos_without_the_flag_as_llama_cpp(tmp_path, pre):
    """A byte-level BPE file without tokenizer.ggml.add_bos_token: llama.cpp (src/llama-vocab.cpp) adds the BOS for
    LLAMA3's and TEKKEN's names (Llama 3 files of older converters have no flag) and for no other; the file's flag,
    where it has one, wins either way."""
    path = str(tmp_path / "bos.gguf")
    llama_cpp_adds = pre in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0", "tekken")
    for flag, adds in [(None, llama_cpp_adds), (True, True), (False, False)]:
        _write_tokenizer_gguf(path, pre, add_bos=flag)
        tok = gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)
        bare = tok.encode("12", add_special_tokens=False)
        assert tok.encode("12") == [0] * adds + bare, (pre, flag)


def test_tokenizer_entry_key_follows_the_conversion_version(tmp_path, monkeypatch):
    """A tokenizer cached by an older conversion is never served: its entry's key changes with
    CONVERSION_VERSION, while the dequantized weights' entry (which does not depend on it) is kept."""
    path, root = str(tmp_path / "m.gguf"), tmp_path / "cache"
    write_tiny_gguf(path, "Q8_0")
    cache = ArtifactCache(str(root))

    def keys(kind):
        return sorted(p.name for p in (root / kind).iterdir() if not p.name.startswith("."))

    for _ in open_gguf(path, cache).weights():
        pass
    first, weights = keys("gguf"), keys("gguf_float")
    monkeypatch.setattr(gguf_tokenizer, "CONVERSION_VERSION", gguf_tokenizer.CONVERSION_VERSION + 1)
    for _ in open_gguf(path, cache).weights():
        pass
    assert len(first) == 1 and len(keys("gguf")) == 2 and keys("gguf_float") == weights


def test_default_model_splits_as_smollm2s_own_tokenizer():
    """The default model's file says "smollm". SmolLM2's tokenizer.json splits with Digits(individual_digits)
    then GPT-2's ByteLevel; ours must encode as that does. The old GPT-2-only split did not where spaces come
    before a digit ("x  1": "Ġ", "Ġ", "1" where SmolLM2 has "ĠĠ", "1")."""
    from tokenizers import Tokenizer
    from tokenizers import pre_tokenizers as pt

    from picovllm.loader.default_model import default_model_path
    path = default_model_path()
    gf = GGUFFile(path)
    assert gf.metadata["tokenizer.ggml.pre"] == "smollm"
    ours = gguf_tokenizer.from_metadata(gf.metadata, path)
    theirs = Tokenizer.from_str(ours.backend_tokenizer.to_str())
    theirs.pre_tokenizer = pt.Sequence([pt.Digits(individual_digits=True),
                                        pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    texts = ["x  1", "hello  2024", "a\n\t2", "1234567 + 89 = ?", "naïve café 東京 🙂 ١٢٣", "I'm sure they'll",
             "def f(n):\n    return n**2  # 42\n\n\n"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False).ids, text
    assert ours.convert_ids_to_tokens(ours.encode("x  1", add_special_tokens=False)) == ["x", "ĠĠ", "1"]


def test_the_files_special_tokens_win_over_the_converters(tmp_path, monkeypatch):
    """transformers 5.17's GGUF converters return special tokens of their own (its gpt2 one an unk_token) beside
    those the file names: both went to the tokenizer's constructor, which refused the second (the default model did
    not load on 5.17). The file's are kept."""
    path = str(tmp_path / "v3.gguf")
    _write_tokenizer_gguf(path, "deepseek-v3")
    meta = dict(GGUFFile(path).metadata)
    meta["tokenizer.ggml.unknown_token_id"] = 2
    real = gguf_tokenizer._gguf_converter()
    monkeypatch.setattr(gguf_tokenizer, "_gguf_converter", lambda: lambda arch, d: (
        lambda backend, extra: (backend, {**extra, "unk_token": "<|not the file's|>", "bos_token": "3"}))(
        *real(arch, d)))
    tok = gguf_tokenizer.from_metadata(meta, path)
    tokens = meta["tokenizer.ggml.tokens"]
    assert (tok.unk_token, tok.bos_token) == (tokens[2], tokens[0])


# -- ignore_merges: a word that is a token is taken whole (llama.cpp's LLAMA3 and TEKKEN names) --------------------
def _tiktoken_oracle(monkeypatch, ranks: dict[bytes, int]):
    """transformers' TikTokenConverter (what made Llama 3's tokenizer.json from its tiktoken ranks; its default split
    is Llama 3's) over `ranks`."""
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter
    monkeypatch.setattr(TikTokenConverter, "load_tiktoken_bpe", staticmethod(lambda _: ranks))
    return Tokenizer.from_str(TikTokenConverter(vocab_file="ranks").converted().to_str())


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken"])
def test_llama3_file_takes_a_word_that_is_a_token_whole(tmp_path, monkeypatch, pre):
    """"abcd" is a token, but its merges (ab cd) never meet: "bc" merges first and "abc", "bcd" are no tokens, so
    merges alone leave "a", "bc", "d". Llama 3's tokenizer (tiktoken, and its tokenizer.json's ignore_merges) and
    llama.cpp take the word whole."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"bc": 256, b"ab": 257, b"cd": 258, b"abcd": 259})
    oracle = _tiktoken_oracle(monkeypatch, ranks)
    vocab = oracle.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    path = str(tmp_path / "l3.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges([" ".join(m) for m in json.loads(oracle.to_str())["model"]["merges"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)
    for text in ["abcd", "x abcd abc", "bcd abcdabcd"]:
        assert ours.encode(text, add_special_tokens=False) == oracle.encode(text).ids, text
    assert ours.encode("abcd", add_special_tokens=False) == [259]


def test_gpt2_file_still_merges_a_word_that_is_a_token(tmp_path):
    """Names llama.cpp does not give ignore_merges keep plain BPE (GPT-2's own tokenizer.json has no ignore_merges)."""
    path = str(tmp_path / "gpt2.gguf")
    _write_tokenizer_gguf(path, "gpt-2")
    assert not gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path).backend_tokenizer.model.ignore_merges
