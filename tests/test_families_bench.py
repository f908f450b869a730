"""benchmarks/families_gpu.py, the GPU benchmark of issue 18, run end to end on toy shapes (--tiny) so that it is not
broken when it reaches the GPU: picovllm on a "random:" model, then HF transformers' continuous batching on the
same weights (the script itself checks, by greedy tokens against HF, that they are the same)."""
import json
import os
import subprocess
import sys

import pytest

from picovllm import LLM, SamplingParams
from picovllm.bench.random_checkpoint import make_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "families.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "families_gpu.py"), "--tiny", "--only",
                           "qwen3-30b-a3b", "gemma2-2b", "--peer-attn", "sdpa", "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out))["results"]
    ours = {r["model"]: r for r in results if r.get("engine") == "picovllm"}
    assert set(ours) == {"tiny-qwen3-moe", "tiny-gemma2"}
    for r in ours.values():
        assert r["output_tokens"] == 8 * 16 and r["output_tok_per_s"] > 0 and r["same_weights_as_peer"] is True
    (peer,) = [r for r in results if r.get("engine") == "hf_cb[sdpa]"]
    assert peer["model"] == "tiny-qwen3-moe" and peer["finished"] == 8 and peer["output_tokens"] == 8 * 16
    assert list(results[-1]["ratios"]) == ["tiny-qwen3-moe / hf_cb[sdpa]"]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gemma2", "tiny-gpt-oss", "tiny-glm-4.5",
                                    "tiny-deepseek-v2-lite"])
def test_random_source_is_the_written_checkpoint(tmp_path, preset):
    """"random:<preset>" generates the tensors make_random_checkpoint writes (same names, seeds, values); HF reads
    the written checkpoint with no tensor missing or left over (DeepSeek's latent attention's names)."""
    folder = make_random_checkpoint(str(tmp_path / preset), preset)
    if preset == "tiny-deepseek-v2-lite":
        from transformers import AutoModelForCausalLM
        _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    a, b = (LLM(m, device="cpu", num_kv_blocks=32).generate([[3, 1, 4, 1, 5, 9]], sp, use_tqdm=False)[0].outputs[0]
            for m in (folder, f"random:{preset}"))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_random_config_takes_the_tokenizer_beside_it(tmp_path):
    """"random:<config.json>" with a tokenizer saved in the config's folder reads text prompts with that tokenizer
    (structured_output.py --random-model); the same config alone takes token ids only."""
    import json as json_
    from picovllm.bench.random_checkpoint import resolve_config, write_word_tokenizer
    cfg = resolve_config("tiny-qwen3")
    for name, with_tokenizer in (("alone", False), ("with", True)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json_.dumps(cfg))
        if with_tokenizer:
            write_word_tokenizer(str(folder), cfg["vocab_size"])
        llm = LLM(f"random:{folder / 'config.json'}", device="cpu", num_kv_blocks=32)
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        if not with_tokenizer:
            with pytest.raises(Exception, match="tokenizer"):
                llm.generate(["t5 t7 t9"], sp, use_tqdm=False)
            continue
        out = llm.generate(["t5 t7 t9"], sp, use_tqdm=False)[0]
        assert out.prompt_token_ids == [5, 7, 9]
        assert out.outputs[0].text.split() == [f"t{i}" for i in out.outputs[0].token_ids]
