"""Tool calling for /v1/chat/completions: tools into the prompt, calls out of the output. The code is the
tool_parsers package (its docstring maps it: one module a calls' format, and the shared policy, registry, streaming
and prompt modules); this module re-exports the names the server, the offline API and the tests import, so that
they need not know the package's layout."""
from __future__ import annotations

from picovllm.entrypoints.openai.tool_parsers.base import (UNPARSED, SectionFormat, ToolCall, ToolParser,
                                                           json_or_text, partial_tag, without_markers)
from picovllm.entrypoints.openai.tool_parsers.policy import ANY_OBJECT, TOOLS_SOURCES, ToolPolicy
from picovllm.entrypoints.openai.tool_parsers.prompt import (template_arguments, template_renders_tools,
                                                             tool_system_prompt, with_tool_prompt)
from picovllm.entrypoints.openai.tool_parsers.registry import (BLOCK_PARSERS, SECTION_FORMATS, SPECIAL_MARKER_PARSERS,
                                                               TOOL_PARSERS, detect_tool_parser, has_token,
                                                               tool_parser)
from picovllm.entrypoints.openai.tool_parsers.streaming import AutoToolStream

__all__ = ["ANY_OBJECT", "BLOCK_PARSERS", "SECTION_FORMATS", "SPECIAL_MARKER_PARSERS", "TOOLS_SOURCES",
           "TOOL_PARSERS", "UNPARSED", "AutoToolStream", "SectionFormat", "ToolCall", "ToolParser", "ToolPolicy",
           "detect_tool_parser", "has_token", "json_or_text", "partial_tag", "template_arguments",
           "template_renders_tools", "tool_parser", "tool_system_prompt", "with_tool_prompt", "without_markers"]
