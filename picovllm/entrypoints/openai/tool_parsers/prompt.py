"""The tools into the prompt: through the model's chat template (apply_chat_template(tools=...)) where the template
uses them (template_renders_tools), else the fallback for templates without tool support: a system message that
describes the tools and asks for calls in the hermes format (with_tool_prompt). Also an earlier call's arguments as
chat templates take them (template_arguments)."""
from __future__ import annotations

import json
import re
from typing import Any

from picovllm.entrypoints.openai.tool_parsers.base import json_or_text


def template_arguments(text: str | None) -> Any:
    """An earlier call's arguments as chat templates take them (Qwen's, HF's convention): an object, not JSON text;
    none (an empty string) as {}, as vLLM passes them."""
    return json_or_text(text) if (text or "").strip() else {}


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template uses the `tools` it is given (else they would silently vanish)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tool_system_prompt(tools: list[dict]) -> str:
    """For templates without tool support: the tools and the call format, as a system message."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call functions to help with the user's request. The functions, as JSON:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, reply with a JSON object with its name and arguments within tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with the tools' description added to the system message (a new one first if none)."""
    prompt = tool_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        if isinstance(content, list):         # text parts (a template that loops over them)
            content = content + [{"type": "text", "text": prompt}]
        else:
            content = f"{content}\n\n{prompt}"
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
