"""The Triton grammar-mask kernel (kernels/token_mask.py) against the hand-computed oracle of
test_structured_output (bit t % 32 of word t // 32, by Python ints): all rows masked, some rows left as they are,
and fewer words than the vocabulary needs (the tokens past them forbidden). Interpreted on the CPU, compiled on a GPU."""
import pytest
import torch

from test_kernels import compiled, interpreted
from test_structured_output import allowed_oracle

from picovllm.kernels.token_mask import mask_logits        # noqa: E402


@pytest.mark.parametrize("device,dtype", [interpreted("cpu", torch.float32, id="interp-fp32"),
                                          compiled("cuda", torch.bfloat16, id="gpu-bf16"),
                                          compiled("cuda", torch.float32, id="gpu-fp32")])
@pytest.mark.parametrize("vocab,num_words", [(5000, 157), (5000, 150), (70, 3)])   # 150 words: tokens past 4800
@pytest.mark.parametrize("rows", [None, [2, -1, 0, -1]], ids=["all-rows", "some-rows"])
def test_mask_kernel_matches_the_bit_oracle(device, dtype, vocab, num_words, rows):
    g = torch.Generator().manual_seed(vocab + num_words)
    words = torch.randint(-2**31, 2**31 - 1, (4, num_words), dtype=torch.int32, generator=g)
    words[1] = 0            # nothing allowed
    words[2] = -1           # everything (within 32 W)
    logits = torch.randn(4, vocab, generator=g, dtype=torch.float64) * 10
    logits[3, :7] = float("-inf")           # already banned stays banned
    word_rows = None if rows is None else torch.tensor(rows, dtype=torch.int32, device=device)
    out = mask_logits(logits.to(device, dtype), words.to(device), word_rows)
    allowed = allowed_oracle(words, vocab)
    expect = logits.clone()
    for r in range(4):
        w = r if rows is None else rows[r]
        if w >= 0:
            for t, ok in enumerate(allowed[w]):
                if not ok:
                    expect[r, t] = float("-inf")
    assert out.dtype == dtype and out.device.type == device
    assert torch.equal(out.cpu().double(), expect.to(dtype).double())
    assert not torch.equal(out.cpu().double(), logits.to(dtype).double())    # the mask did something
