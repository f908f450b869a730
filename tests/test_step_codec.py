"""The binary RunStep frame (engine/step_codec.py): round trips, and malformed frames name their field."""
import struct
from dataclasses import replace

import pytest

from picovllm.engine.messages import PROTOCOL_VERSION, RunStep, decode, encode
from picovllm.engine.step_codec import MAGIC, _HEADER
from picovllm.engine.step_input import SamplingRow, StepInput


def mixed_step() -> StepInput:
    """Two decodes (one reading the step in flight) and a prefill chunk of 3 tokens with a big slot."""
    return StepInput(input_ids=[5, 0, 9, 10, 11], positions=[7, 3, 0, 1, 2], slot_mapping=[23, 2**33 + 1, 40, 41, 42],
                     query_start_loc=[0, 1, 2, 5], seq_lens=[8, 4, 3], block_tables=[[1, 2], [7], [10]],
                     num_decodes=2, sample_indices=[0, 1, 4],
                     sampling=[SamplingRow(0.7, 5, 0.9, 0.0, 2**62 + 1, [2, 3], 4),
                               SamplingRow(0.0, 0, 1.0, 0.1, None, [], None, 0.5, -1.0, 1.2, [3], [-2.5], [4], [5], 1),
                               SamplingRow(1.0, 0, 1.0, 0.0, None, [], 0)],
                     prev_dst=[1], prev_src=[0], prompt_indices=[2, 3], prompt_targets=[10, 11], prompt_topk=[0, 3])


@pytest.mark.parametrize("rows", [True, False])
def test_round_trip(rows):
    step = mixed_step() if rows else replace(mixed_step(), sampling=[])
    data = encode(RunStep(step))
    assert data[:4] == MAGIC
    assert decode(data) == RunStep(step)


def test_tp_step_has_no_rows_and_is_compact():
    """What TP workers get: no sampling rows, 4 bytes per id/position/table entry."""
    step = replace(mixed_step(), sampling=[])
    n, s = len(step.input_ids), len(step.seq_lens)
    want = _HEADER.size + n * (4 + 4 + 8) + 4 * ((s + 1) + s + (s + 1) + 4 + 3 + 1 + 1 + 3 * 2)
    assert len(encode(RunStep(step))) == want


def _header(data: bytes, **change) -> bytes:
    names = ["magic", "version", "n", "s", "num_decodes", "k", "p", "t", "m", "j"]
    values = dict(zip(names, _HEADER.unpack_from(data)))
    values.update(change)
    return _HEADER.pack(*values.values()) + data[_HEADER.size:]


def _first_table_offset(data: bytes, value: int) -> bytes:
    """mixed_step's frame with block_table_offsets[0] rewritten (after ids, positions, slots, qsl, lens)."""
    at = _HEADER.size + 5 * (4 + 4 + 8) + 4 * (4 + 3)
    return data[:at] + struct.pack("<i", value) + data[at + 4:]


@pytest.mark.parametrize("mangle, field", [
    (lambda d: d[:-1], r"RunStep\.step\.sampling"),
    (lambda d: d[:_HEADER.size + 4], r"RunStep\.step\.input_ids"),
    (lambda d: d[:10], r"RunStep\.step: 10 bytes, shorter than"),
    (lambda d: d + b"\0", r"RunStep\.step: 1 bytes after the last field"),
    (lambda d: _header(d, version=PROTOCOL_VERSION + 1), r"RunStep\.step: message version"),
    (lambda d: _header(d, t=5), r"RunStep\.step\.sampling: the frame ends"),   # later fields shift
    (lambda d: _first_table_offset(d, 1), r"RunStep\.step\.block_tables: offsets"),
    (lambda d: _header(d, num_decodes=9), r"RunStep\.step\.num_decodes"),
    (lambda d: _header(d, s=2), r"RunStep\.step\."),                         # every later field shifts
    (lambda d: d[:-3] + b"xx]", r"RunStep\.step\.sampling"),
])
def test_malformed_frame_names_the_field(mangle, field):
    with pytest.raises(ValueError, match=field):
        decode(mangle(encode(RunStep(mixed_step()))))


def test_query_start_loc_must_cover_the_tokens():
    bad = replace(mixed_step(), query_start_loc=[0, 1, 2, 4])
    with pytest.raises(ValueError, match=r"RunStep\.step\.query_start_loc"):
        decode(encode(RunStep(bad)))


def test_json_frames_still_decode():
    """The control messages stay JSON next to the binary RunStep; a frame is told apart by its magic."""
    from picovllm.engine.messages import AllocateKVCache, Shutdown
    for msg in (AllocateKVCache(3), Shutdown()):
        assert decode(encode(msg)) == msg
    assert not encode(Shutdown()).startswith(MAGIC)
    assert struct.calcsize("<4sH8I") == _HEADER.size
