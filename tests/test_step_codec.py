"""The binary RunStep frame (engine/step_codec.py): round trips, malformed frames name their field, and block
tables sent as deltas rebuild rank 0's tables on a worker."""
import random
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from picovllm.engine.messages import PROTOCOL_VERSION, RunStep, decode, encode
from picovllm.engine.step_codec import MAGIC, _HEADER, ReceivedTables, SentTables
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
    """What TP workers get: no sampling rows, 4 bytes per id/position/table entry, 8 + 4 per row for its table's key
    and base."""
    step = replace(mixed_step(), sampling=[])
    n, s = len(step.input_ids), len(step.seq_lens)
    want = _HEADER.size + n * (4 + 4 + 8) + s * (8 + 4) + 4 * ((s + 1) + s + (s + 1) + 4 + 3 + 1 + 1 + 3 * 2)
    assert len(encode(RunStep(step))) == want


def _header(data: bytes, **change) -> bytes:
    names = ["magic", "version", "n", "s", "num_decodes", "k", "p", "t", "m", "j"]
    values = dict(zip(names, _HEADER.unpack_from(data)))
    values.update(change)
    return _HEADER.pack(*values.values()) + data[_HEADER.size:]


def _first_table_offset(data: bytes, value: int) -> bytes:
    """mixed_step's frame with block_table_offsets[0] rewritten (after ids, positions, slots, the tables' keys,
    qsl, lens, the tables' bases)."""
    at = _HEADER.size + 5 * (4 + 4 + 8) + 3 * 8 + 4 * (4 + 3 + 3)
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


# -- block tables as deltas (SentTables on rank 0, ReceivedTables on a worker) ------------------------------------
def tables_step(tables: list[list[int]]) -> StepInput:
    """A decode step of these rows' block tables (the other fields only need to be consistent)."""
    s = len(tables)
    return StepInput(input_ids=[0] * s, positions=[0] * s, slot_mapping=[0] * s, query_start_loc=list(range(s + 1)),
                     seq_lens=[1] * s, block_tables=tables, num_decodes=s, sample_indices=[], sampling=[])


def frame_entries(data: bytes) -> int:
    return _HEADER.unpack_from(data)[7]


def random_steps(rng: random.Random, num_steps: int):
    """Rank 0's tables step by step, as the scheduler changes them: requests arrive, grow by appends in place, get
    new lists (a window sliding out, preemption), sit a step out, finish; a speculative one fills several rows."""
    running: dict[int, list[int]] = {}
    next_rid, next_block = 0, 1000
    for _ in range(num_steps):
        for rid in list(running):
            r = rng.random()
            if r < 0.05:
                del running[rid]                                      # finished or aborted
            elif r < 0.1:
                running[rid] = [-1] + running[rid][1:]                # a new list: the first block slid out
            elif r < 0.13:
                running[rid] = [next_block]                           # preempted, recomputed in a new table
                next_block += 1
            elif r < 0.5:
                grow = rng.randint(1, 3)
                running[rid] += range(next_block, next_block + grow)  # in place
                next_block += grow
        for _ in range(rng.randint(0, 3)):
            running[next_rid] = list(range(next_block, next_block + rng.randint(1, 5)))
            next_rid, next_block = next_rid + 1, next_block + 5
        rows = []
        for rid, table in running.items():
            if rng.random() < 0.1:
                continue                                              # not scheduled this step
            rows += [table] * (rng.randint(1, 3) if rid % 4 == 0 else 1)   # speculative rows share the table
        if rows:
            yield rows


@pytest.mark.parametrize("seed", range(4))
def test_deltas_rebuild_every_table_and_keep_appended_lists(seed):
    """The independent oracle: each step, the worker's tables equal rank 0's; a table rank 0 only appended to since
    the step before is the worker's same list as then (so its StagedTables writes only the new entries), rows
    sharing a table share one; only the entries gained travel."""
    from picovllm.engine.cuda_graph import StagedTables
    sent, received = SentTables(), ReceivedTables()
    staged, dst = StagedTables(64, 128), torch.zeros(64, 128, dtype=torch.int32)
    before: dict[int, tuple[list[int], int, list[int]]] = {}    # id(rank 0's table) -> (it, its length, worker's)
    for rows in random_steps(random.Random(seed), 200):
        data = encode(RunStep(tables_step(rows)), sent)
        got = decode(data, received).step.block_tables
        assert got == rows
        now, gained = {}, 0
        for table, mine in zip(rows, got):
            if id(table) in now:
                assert mine is now[id(table)][2]
                continue
            kept = before.get(id(table))
            if kept is not None and kept[0] is table:
                assert mine is kept[2]
                gained += len(table) - kept[1]
            else:
                assert all(mine is not k[2] for k in before.values())
                gained += len(table)
            now[id(table)] = (table, len(table), mine)
        assert frame_entries(data) == gained
        before = now
        staged.upload(got, max(map(len, got)), dst)
        for i, table in enumerate(rows):
            assert dst[i, :len(table)].tolist() == table


def test_tables_of_rows_gone_are_dropped_and_come_back_whole():
    """Both halves hold exactly the last step's tables: one that sat a step out goes whole, under a new key."""
    sent, received = SentTables(), ReceivedTables()
    a, b = [1, 2, 3], [7]
    decode(encode(RunStep(tables_step([a, b])), sent), received)
    a.append(4)
    data = encode(RunStep(tables_step([a, a])), sent)
    assert frame_entries(data) == 1
    decode(data, received)
    assert len(sent._sent) == len(received._held) == 1
    b.append(8)
    data = encode(RunStep(tables_step([b, a])), sent)
    assert frame_entries(data) == 2
    assert decode(data, received).step.block_tables == [[7, 8], [1, 2, 3, 4]]
    decode(encode(RunStep(tables_step([b])), sent), received)
    assert len(sent._sent) == len(received._held) == 1


def test_a_delta_against_tables_the_worker_lacks_is_an_error():
    sent, received = SentTables(), ReceivedTables()
    table = [1, 2]
    first = encode(RunStep(tables_step([table])), sent)
    table.append(3)
    second = encode(RunStep(tables_step([table])), sent)
    with pytest.raises(ValueError, match=r"RunStep\.step\.block_table_keys: key 0 extends a table of 2 entries"):
        decode(second)                                                    # a worker that holds nothing
    held = decode(first, received).step.block_tables[0]
    assert decode(second, received).step.block_tables[0] is held
    with pytest.raises(ValueError, match=r"RunStep\.step\.block_table_bases: key 0 extends a table of 2 entries, "
                                         r"this worker's has 3"):
        decode(second, received)                                          # the same delta twice
    assert held == [1, 2, 3]


def test_a_bad_frame_leaves_the_held_tables_as_they_were():
    """Rows before the one found bad were appended to already: they are cut back (the tables stay rank 0's)."""
    received = ReceivedTables()
    held = decode(encode(RunStep(tables_step([[1, 2], [5]]))), received).step.block_tables
    keys, bases, offsets, entries = (np.array(v, dtype=d) for v, d in
                                     (([0, 1], "<i8"), ([2, 2], "<i4"), ([0, 1, 2], "<i4"), ([3, 6], "<i4")))
    with pytest.raises(ValueError, match=r"where\.block_table_bases: key 1 extends a table of 2 entries"):
        received.receive(keys, bases, offsets, entries, "where")
    assert held == [[1, 2], [5]]
    got = received.receive(keys, np.array([2, 1], dtype="<i4"), offsets, entries, "where")
    assert got == [[1, 2, 3], [5, 6]] and all(g is h for g, h in zip(got, held))
