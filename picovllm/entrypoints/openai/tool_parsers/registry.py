"""The tool-call parsers by name (TOOL_PARSERS: the names --tool-call-parser takes, as vLLM's), the groups the server
and the streaming reader ask about, and the choice of the format a model speaks from its tokenizer and chat template
(detect_tool_parser). A new format is a parser module and one entry in PARSERS."""
from __future__ import annotations

from picovllm.entrypoints.openai.tool_parsers.base import BlockParser, SectionParser, ToolParser
from picovllm.entrypoints.openai.tool_parsers.deepseek import DEEPSEEK, DeepseekV3Parser, DeepseekV31Parser
from picovllm.entrypoints.openai.tool_parsers.glm45 import Glm45Parser
from picovllm.entrypoints.openai.tool_parsers.hermes import HermesParser
from picovllm.entrypoints.openai.tool_parsers.kimi_k2 import KIMI_K2, KimiK2Parser
from picovllm.entrypoints.openai.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from picovllm.entrypoints.openai.tool_parsers.mistral import MISTRAL_CALLS, MistralParser
from picovllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    HermesParser(), Glm45Parser(), Llama3JsonParser(), MistralParser(), Qwen3CoderParser(), DeepseekV3Parser(),
    DeepseekV31Parser(), KimiK2Parser())}
TOOL_PARSERS = tuple(PARSERS)
BLOCK_PARSERS = tuple(n for n, p in PARSERS.items() if isinstance(p, BlockParser))   # each call as its block closes
SECTION_FORMATS = {n: p.fmt for n, p in PARSERS.items() if isinstance(p, SectionParser)}
# the formats whose markers are special tokens: the server keeps them in the text for the parser
SPECIAL_MARKER_PARSERS = tuple(n for n, p in PARSERS.items() if p.special_markers)


def tool_parser(name: str) -> ToolParser:
    """The parser of a name of TOOL_PARSERS."""
    return PARSERS[name]


def detect_tool_parser(tokenizer, chat_template: str | None) -> str:
    """The calls' format a model speaks (TOOL_PARSERS): mistral where its tokenizer has a [TOOL_CALLS] token,
    deepseek_v3 where it has a <｜tool▁calls▁begin｜> token (deepseek_v31 where the chat template writes V3.1's calls:
    the name right after <｜tool▁call▁begin｜>, no ```json), kimi_k2 where it has <|tool_calls_section_begin|>,
    qwen3_coder where its chat template writes <function=...> and <parameter=...>, glm45 where it writes <arg_key>
    pairs, llama3_json where the template is Llama 3's (tools through `Environment: ipython` / <|python_tag|>),
    else hermes."""
    if has_token(tokenizer, MISTRAL_CALLS):
        return "mistral"
    if has_token(tokenizer, DEEPSEEK.begin):      # V3.1's template writes NAME right after the call's marker
        v31 = chat_template and DEEPSEEK.call_begin in chat_template and "```json" not in chat_template
        return "deepseek_v31" if v31 else "deepseek_v3"
    if has_token(tokenizer, KIMI_K2.begin):
        return "kimi_k2"
    if chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if chat_template and (PYTHON_TAG in chat_template or "Environment: ipython" in chat_template):
        return "llama3_json"
    return "hermes"


def has_token(tokenizer, marker: str) -> bool:
    """Whether the tokenizer has marker as one token of its own."""
    try:
        return tokenizer is not None and len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    except Exception:       # a tokenizer that cannot encode: not one with this marker
        return False
