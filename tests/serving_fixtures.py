"""For the server tests: a tiny random-weight model that has a real (small, trained) tokenizer and chat
template, and a server subprocess on a free port."""
from __future__ import annotations

import contextlib
import http.server
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import build_tiny_checkpoint

# ChatML, and Qwen3's way of turning thinking off (a variable that chat_template_kwargs sets)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]    # ids 0, 1, 2: LlamaConfig's bos=1, eos=2
CORPUS = ("The capital of France is Paris. Tell me a story about a cat who lives on the moon. "
          "Hello, how are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9. "
          "The quick brown fox jumps over the lazy dog. A server streams tokens to its clients. ") * 20


def build_tiny_chat_model(path: str, bos: bool = False, **overrides) -> str:
    """Tiny llama (vocab 384) plus a byte-level BPE tokenizer trained on the spot, with a ChatML template.
    bos: its encode adds the BOS token (<|im_start|>) in front, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    build_tiny_checkpoint(path, "llama", **overrides)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() <= 384
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                                           special_tokens=[("<|im_start|>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token=None, pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return path


def train_replies(path: str, seqs: list[tuple[list[int], list[int]]], stops: list[int]) -> str:
    """Replace the tiny chat model's weights in path by a tiny Llama trained (teacher-forced, to a loss near 0) to
    answer each prompt's ids with its reply's ids, so that it says them greedily (a served parser then reads what
    a model wrote); stops: its EOS tokens (config and generation config)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=stops, bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = 0
        for prompt, reply in seqs:
            ids = torch.tensor([prompt + reply])
            labels = torch.tensor([[-100] * len(prompt) + reply])
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-2, loss.item()
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=stops, bos_token_id=1).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tinychat") / "model"))


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory) -> str:
    """The tiny chat model with <think> and </think> as tokens of their own (added, not special: as Qwen3's and
    DeepSeek-R1's tokenizers have them)."""
    from transformers import AutoTokenizer
    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("thinking") / "model"), vocab_size=400)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    assert max(tok.convert_tokens_to_ids(["<think>", "</think>"])) < 400
    tok.save_pretrained(path)
    return path


def free_port() -> int:
    """A port free now, drawn below Linux's ephemeral range (32768-60999): a port the kernel hands out (bind to 0)
    goes back to its pool once closed, and an outgoing connection of any process can take it before the server that
    was meant to listen there starts (CI lost a run so: "Address already in use"). Drawn with the system's randomness,
    so xdist workers whose `random` a test seeded alike draw apart."""
    draw = random.SystemRandom()
    while True:
        port = draw.randrange(10000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@contextlib.contextmanager
def file_server(get, put):
    """An HTTP server for URL inputs and outputs (run-batch's -i and -o), on a thread of its own: a GET of a path
    answers get(path) -> (status, body bytes), a PUT answers put(path, body bytes) -> status. Yields its base URL."""
    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = get(self.path)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):
            self.send_response(put(self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.end_headers()

        def log_message(self, *a):
            pass

    with http_server(Files) as url:
        yield url


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]):
    """A local HTTP server of handler on a thread of its own; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class ServerProcess:
    """`python -m picovllm.entrypoints.cli serve ...` in a subprocess, with its log in a file.

    A `serve` here runs its engine loop as a thread (--no-engine-process) unless extra says --engine-process:
    spawning the engine's process costs a start ~2 s on the 2-core CI machine, and the features the servers' tests
    check are the same in both modes. The process mode (serve's default) is tested where it is named:
    test_engine_process.py, pair 0 of test_pd_serving.py, the fleet's p and d0 in test_pd_router.py."""

    def __init__(self, model: str | None, log_path: str, *extra: str, startup_timeout: float | None = 120.0,
                 command: tuple[str, ...] = ("serve",), env: dict[str, str] | None = None) -> None:
        """command: the CLI subcommand; model None: no --model; startup_timeout None: do not wait (wait_ready);
        env: variables set beside the usual ones (PYTHONPATH's entries go first)."""
        if command == ("serve",) and "--engine-process" not in extra and "--no-engine-process" not in extra:
            extra = (*extra, "--no-engine-process")
        self.model = model
        extra_env = dict(env or {})
        path = [extra_env.pop("PYTHONPATH")] if "PYTHONPATH" in extra_env else []
        self._env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                         PYTHONPATH=os.pathsep.join(path + [os.getcwd()] + sys.path), **extra_env)
        self._argv = [sys.executable, "-m", "picovllm.entrypoints.cli", *command,
                      *(["--model", model] if model else [])]
        self._extra = extra             # after our --port: a test's own --port wins
        self.log_path = log_path
        self._relaunches = 3
        self._launch()
        if startup_timeout is not None:
            self._wait_ready(startup_timeout)

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*self._argv, "--port", str(self.port), *self._extra], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self._env)

    def _lost_its_port(self) -> bool:
        """Whether the server exited because another process took its HTTP port between free_port and its bind."""
        return f"--port {self.port}: cannot listen there: Address already in use" in self.log()

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if self._relaunches and self._lost_its_port():
                    self._relaunches -= 1
                    self._log.close()
                    self._launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until no request is left in the engine (none running, none waiting) and every KV block is free; the
        metrics then (AssertionError naming them if that takes over timeout seconds)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m["picovllm:num_requests_running"] == 0 and m["picovllm:num_requests_waiting"] == 0 and \
                    m["picovllm:kv_cache_free_blocks"] == m["picovllm:kv_cache_num_blocks"] > 0:
                return m
            assert time.time() < deadline, f"server not idle: {m}"
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """Sample values of /metrics, by name (labels dropped; one series per name is enough here)."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                if "outcome=" in name:
                    key += "." + name.split('outcome="')[1].split('"')[0]
                out[key] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
