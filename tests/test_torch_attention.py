"""The torch attention backend (the CPU path) against a float64 loop over sequences, and its decode grouping."""
import random

import pytest
import torch

from picovllm.layers.attention import AttentionMetadata, TorchAttentionBackend
from picovllm.layers.decode_plan import group_by_length, plan_decode

BS, HQ, HKV, D = 4, 4, 2, 8


def naive(q, keys, vals, scale, window=None, softcap=None):
    """q [ql, Hq, D] for the last ql positions of keys/vals [L, Hkv, D], causal (the last `window` keys of each
    query's prefix), float64, head h -> KV head h // G."""
    ql, L = q.shape[0], keys.shape[0]
    g = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(ql):
        visible = L - ql + t + 1
        lo = 0 if window is None else max(0, visible - window)
        for h in range(q.shape[1]):
            s = (keys[lo:visible, h // g].double() @ q[t, h].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[t, h] = torch.softmax(s, 0) @ vals[lo:visible, h // g].double()
    return out


def make_batch(query_lens, seq_lens, num_decodes, seed=0):
    """A batch whose earlier context is already in a paged cache with scattered blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = sum(-(-n // BS) for n in seq_lens)
    nb = need + 8
    free = list(range(nb))
    rng.shuffle(free)
    tables, full_k, full_v = [], [], []
    k_cache, v_cache = torch.zeros(nb, BS, HKV, D), torch.zeros(nb, BS, HKV, D)
    slots, new_k, new_v = [], [], []
    for ql, L in zip(query_lens, seq_lens):
        table = [free.pop() for _ in range(-(-L // BS))]
        tables.append(table)
        ks, vs = torch.randn(L, HKV, D), torch.randn(L, HKV, D)
        full_k.append(ks)
        full_v.append(vs)
        for p in range(L):
            slot = table[p // BS] * BS + p % BS
            if p < L - ql:        # context: already cached
                k_cache.view(-1, HKV, D)[slot], v_cache.view(-1, HKV, D)[slot] = ks[p], vs[p]
            else:                 # this step's tokens: the backend stores them
                slots.append(slot)
                new_k.append(ks[p])
                new_v.append(vs[p])
    width = max(map(len, tables))
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=num_decodes, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    q = torch.randn(qsl[-1], HQ, D)
    return q, torch.stack(new_k), torch.stack(new_v), k_cache, v_cache, meta, full_k, full_v


@pytest.mark.parametrize("seq_lens", [
    [1, 3, 4, 5, 17, 40],                 # on and off block boundaries: one group
    [3] * 20 + [300, 297],                # many short, two long: worth splitting into groups
])
def test_decode_matches_float64_loop(seq_lens):
    n = len(seq_lens)
    q, k, v, kc, vc, meta, full_k, full_v = make_batch([1] * n, seq_lens, n)
    scale = D ** -0.5
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    ref = torch.cat([naive(q[i:i + 1], full_k[i], full_v[i], scale) for i in range(n)])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    groups = group_by_length(seq_lens, BS)
    assert (len(groups) > 1) == (n > 6)


def test_mixed_batch_decodes_fresh_and_chunked_prefills():
    # two decodes, a fresh prefill (no context), a chunk of 6 over 11 cached tokens
    query_lens, seq_lens = [1, 1, 9, 6], [7, 33, 9, 17]
    q, k, v, kc, vc, meta, full_k, full_v = make_batch(query_lens, seq_lens, 2, seed=3)
    scale = D ** -0.5
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    starts = meta.query_start_loc.tolist()
    ref = torch.cat([naive(q[a:b], full_k[i], full_v[i], scale)
                     for i, (a, b) in enumerate(zip(starts, starts[1:]))])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_group_by_length_covers_every_row_once_and_never_costs_more():
    rng = random.Random(5)
    for _ in range(50):
        lens = [rng.randint(1, 400) for _ in range(rng.randint(1, 40))]
        groups = group_by_length(lens, 16)
        assert sorted(r for g in groups for r in g) == list(range(len(lens)))

        def cost(gs):
            return sum(len(g) * -(-max(lens[r] for r in g) // 16) * 16 + 256 for g in gs)

        assert cost(groups) <= cost([list(range(len(lens)))])
    assert group_by_length([5, 6, 7], 16) == [[0, 1, 2]]             # same block count: one group
    assert group_by_length([1, 1000], 16, overhead=0) == [[0], [1]]  # free groups: no padding at all


def test_plan_masks_only_past_each_length():
    lens = [3, 8, 5]
    tables = torch.arange(6, dtype=torch.int32).view(3, 2)
    (g,) = plan_decode(lens, tables, 4, torch.float32)
    assert g.rows is None and g.block_ids.tolist() == tables.tolist()
    finite = torch.isfinite(g.mask[:, 0, 0, :])
    assert finite.sum(1).tolist() == lens and finite[:, 0].all()


@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (None, 0.8), (6, 0.8)])
def test_sliding_window_and_softcap_match_float64_loop(window, softcap):
    # decodes within and past the window, a fresh prefill longer than it, a chunk over cached context
    query_lens, seq_lens = [1, 1, 1, 9, 6, 3], [4, 7, 33, 9, 17, 40]
    q, k, v, kc, vc, meta, full_k, full_v = make_batch(query_lens, seq_lens, 3, seed=4)
    q = q * 3     # scores large enough for the cap to matter
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D ** -0.5, window, softcap)
    starts = meta.query_start_loc.tolist()
    ref = torch.cat([naive(q[a:b], full_k[i], full_v[i], D ** -0.5, window, softcap)
                     for i, (a, b) in enumerate(zip(starts, starts[1:]))])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if window is not None:   # the window is not a no-op here
        full = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, D ** -0.5, None, softcap)
        assert not torch.allclose(full, out, atol=1e-3)


def test_decode_reads_no_slid_out_or_stale_table_entry():
    """Decodes under a window with the entries of blocks wholly before it SLID_OUT (-1, given back), and a row's
    entries past its table's end stale (-1 too: the eager steps' StagedTables leave what an earlier table wrote there,
    no longer 0): the length groups gathered whole rows of the table, and index_select refused the -1."""
    window, seq_lens = 6, [3, 9, 30, 37]
    n = len(seq_lens)
    q, k, v, kc, vc, meta, full_k, full_v = make_batch([1] * n, seq_lens, n, seed=6)
    tables = meta.block_tables
    for i, L in enumerate(seq_lens):
        tables[i, :max(0, L - window) // BS] = -1                  # wholly before the window: slid out
        tables[i, -(-L // BS):] = -1                              # past the table's end: stale
    assert (tables == -1).any(1).all()
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D ** -0.5, window)
    ref = torch.cat([naive(q[i:i + 1], full_k[i], full_v[i], D ** -0.5, window) for i in range(n)])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
