"""A sentencepiece GGUF's tokenizer (loader/gguf_tokenizer.py, `tokenizer.ggml.model` "llama") against sentencepiece
itself: a tiny BPE model trained here on the test text, written to a GGUF as llama.cpp's convert_hf_to_gguf.py writes
one (pieces, scores, token types, add_space_prefix from the model's add_dummy_prefix). llama.cpp tokenizes such a file
as sentencepiece does: a space in front of the text where add_space_prefix says so, every space as "▁"."""
from __future__ import annotations

import io
from pathlib import Path

import gguf
import pytest

from picovllm.loader import gguf_tokenizer
from picovllm.loader.gguf_format import GGUFFile

spm = pytest.importorskip("sentencepiece")

TEXT = Path(__file__).parent / "data" / "alice_ch1-2.txt"
# leading and doubled spaces, tabs and newlines, digits, bytes the vocabulary lacks (byte fallback), a literal "▁"
TEXTS = [" Hello", "  two spaces first", "Alice was beginning", "trail  ", "a\nb", "\tTab", "x  1", " \n ",
         "é 日本 😀", "▁literal", "'s 'LL", "Caf\u00e9 cafe\u0301", "12345"]


def _train(add_dummy_prefix: bool):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(TEXT), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=add_dummy_prefix, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _token_type(sp, i: int) -> gguf.TokenType:
    for test, kind in ((sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
                       (sp.is_unused, gguf.TokenType.UNUSED), (sp.is_byte, gguf.TokenType.BYTE)):
        if test(i):
            return kind
    return gguf.TokenType.NORMAL


def _write_spm_gguf(path: str, sp, add_space_prefix: bool) -> None:
    """convert_hf_to_gguf.py's _create_vocab_sentencepiece, for a model without added tokens."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([_token_type(sp, i) for i in range(sp.get_piece_size())])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def spm_pair(request, tmp_path_factory):
    """(sentencepiece, our tokenizer of the same model's GGUF)."""
    sp = _train(request.param)
    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    _write_spm_gguf(path, sp, request.param)
    return sp, gguf_tokenizer.from_metadata(GGUFFile(path).metadata, path)


@pytest.mark.parametrize("text", TEXTS)
def test_spm_gguf_encodes_as_sentencepiece(spm_pair, text):
    """The converter's Metaspace added no "▁" before text that starts with a space (" Hello": "▁Hello" where
    sentencepiece has "▁▁Hello") and added one where the file says add_space_prefix false."""
    sp, ours = spm_pair
    assert ours.encode(text, add_special_tokens=False) == sp.encode(text)
    assert ours.encode(text) == [sp.bos_id(), *sp.encode(text)]     # no add_bos_token key: llama.cpp adds BOS


@pytest.mark.parametrize("text", TEXTS)
def test_spm_gguf_decodes_as_sentencepiece(spm_pair, text):
    """The first space is dropped only where the prefix added one."""
    sp, ours = spm_pair
    ids = sp.encode(text)
    assert ours.decode(ids) == sp.decode(ids)


def test_spm_gguf_tokenizer_survives_the_cache(spm_pair, tmp_path):
    """What the artifact cache keeps (save_pretrained, then load_saved) tokenizes the same."""
    sp, ours = spm_pair
    ours.save_pretrained(str(tmp_path))
    back = gguf_tokenizer.load_saved(str(tmp_path))
    assert [back.encode(t, add_special_tokens=False) for t in TEXTS] == [sp.encode(t) for t in TEXTS]
