"""Speculative decoding served: `picovllm serve --speculative-config JSON` (method "ngram"), its engine in a process
of its own (serve's default: the config crosses that boundary), gives the plain engine's tokens, greedy and seeded,
streamed or not, and /metrics counts drafted and accepted tokens under vLLM's names; a bad --speculative-config stops
`picovllm serve` naming the field; the flag reaches generate's and bench's engines, a D server's, and only the D side
of a disaggregated generate (a D engine that speculates: tests/test_spec_decode.py).

Oracle: LLM.generate in this process on the same weights without speculative_config (the plain engine, itself checked
against HF transformers in test_parity_hf.py). The model: the servers' tiny chat model at a small weight scale
(initializer_range 0.05), whose greedy outputs fall into loops and out of them, so drafts are both kept and refused."""
import json
import signal

import openai
import pytest

from picovllm import LLM, SamplingParams
from picovllm.config import SpeculativeConfig
from picovllm.entrypoints.openai.engine_client import EngineStats
from picovllm.entrypoints.openai.metrics import ServerMetrics
from serving_fixtures import ServerProcess, build_tiny_chat_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "256"]
PROMPTS = ["Numbers: 0 1 2 3 4 5 6 7 8 9. Numbers: 0 1 2 3 4 5 6 7 8 9. Numbers: 0 1 2",
           "The capital of France is Paris. The capital of France is", "Hello, how are you"]
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # beside a server process on a shared 2-core machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tinyspec") / "model"), initializer_range=0.05)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=16, num_kv_blocks=512, max_model_len=256)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProcess(model, str(tmp_path_factory.mktemp("log") / "server.log"), *ENGINE_ARGS,
                        "--speculative-config", json.dumps(SPEC), "--engine-process")
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def token_ids(logprobs) -> list[int]:
    """The ids of a completion's tokens, named "token_id:<id>" (return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_served_tokens_are_the_plain_engine_s_and_metrics_count_the_drafts(server, client, llm):
    name = client.models.list().data[0].id
    before = server.metrics()
    assert all(before[k] == 0 for k in SPEC_COUNTERS), before     # there from the start, as in vLLM
    greedy = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=32)
    for prompt, ref, ref_seeded in zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False),
                                       llm.generate(PROMPTS, seeded, use_tqdm=False)):
        rc = ref.outputs[0]
        got = client.completions.create(model=name, prompt=prompt, max_tokens=48, temperature=0, logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": True}).choices[0]
        assert token_ids(got.logprobs) == rc.token_ids and got.text == rc.text
        assert got.finish_reason == rc.finish_reason
        assert got.logprobs.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(rc.logprobs, rc.token_ids)],
                                                            abs=1e-4)
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=name, prompt=prompt, max_tokens=48, temperature=0, stream=True) if ch.choices)
        assert streamed == rc.text
        got = client.completions.create(model=name, prompt=prompt, max_tokens=32, temperature=0.8, seed=7, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True}).choices[0]
        assert token_ids(got.logprobs) == ref_seeded.outputs[0].token_ids
    conv = [{"role": "user", "content": "Numbers: 0 1 2 3 4 5 6 7 8 9. Numbers: 0 1 2"}]
    rc = llm.chat(conv, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=name, messages=conv, max_tokens=40, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == rc.text
    m = server.metrics()
    drafts, drafted, accepted = (m[k] for k in SPEC_COUNTERS)
    assert 0 < accepted < drafted <= SPEC["num_speculative_tokens"] * drafts, m   # drafts kept, and refused
    assert m["picovllm:requests_total.stop"] + m["picovllm:requests_total.length"] == 3 * len(PROMPTS) + 1


def test_the_counters_exist_only_with_speculative_decoding():
    stats = EngineStats(drafts=3, draft_tokens=10, accepted_tokens=6, accepted_per_pos=[3, 2, 1, 0])
    plain, spec = ServerMetrics("m"), ServerMetrics("m", speculative=True)
    for metrics in (plain, spec):
        metrics.observe_engine(stats)
        metrics.observe_engine(EngineStats(drafts=5, draft_tokens=14, accepted_tokens=9,    # totals: increments
                                           accepted_per_pos=[4, 3, 2, 0]))
    assert "spec_decode" not in plain.render()[0].decode()
    text = spec.render()[0].decode()
    for name, value in zip(SPEC_COUNTERS, (5, 14, 9)):
        assert f'{name}{{model_name="m"}} {float(value)}' in text, text
    for pos, value in enumerate([4, 3, 2, 0]):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} '
                f'{float(value)}') in text, text


@pytest.mark.parametrize("spec, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model"),
])
def test_a_bad_speculative_config_stops_serve_naming_the_field(capsys, spec, field):
    from picovllm.entrypoints.cli import main
    assert main(["serve", "--speculative-config", json.dumps(spec)]) == 2
    err = capsys.readouterr().err
    want = "--speculative-config's " + field.split(".", 1)[1]     # the flag the user typed, and its field
    assert err.startswith("picovllm serve: error: ") and f"{want} " in err, err


@pytest.mark.parametrize("flags, field", [(["--role", "p"], "role"), (["--runner", "pooling"], "runner")])
def test_serve_refuses_what_cannot_speculate(capsys, flags, field):
    from picovllm.entrypoints.cli import main
    assert main(["serve", "--speculative-config", json.dumps(SPEC), *flags]) == 2
    assert f"--{field} " in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--role", "d"], ["generate", "hi"], ["bench", "latency"],
                                  ["bench", "throughput"]])
def test_the_flag_reaches_every_command_s_engine_config(argv):
    from picovllm.entrypoints.cli import build_parser
    from picovllm.entrypoints.commands.args import engine_kwargs
    from picovllm.entrypoints.engine_args import engine_config_from_args
    args = build_parser().parse_args([*argv, "--speculative-config", json.dumps(SPEC)])
    if argv[0] == "serve":
        kw = engine_config_from_args(args, model=None).__dict__
    else:       # bench latency's budget and bench throughput's dtype default to None: their run() sets them
        kw = engine_kwargs(args, max_num_batched_tokens=2048, dtype="float32")
    assert kw["speculative_config"] == SpeculativeConfig(**SPEC)


def test_a_disaggregated_generate_speculates_on_its_decode_side_alone():
    from picovllm.disagg.cli import disagg_options
    from picovllm.entrypoints.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--disagg", "--speculative-config", json.dumps(SPEC)])
    opts = disagg_options(args)
    assert json.loads(opts["decode"]["speculative_config"]) == SPEC
    assert "speculative_config" not in opts["prefill"] and "speculative_config" not in opts
