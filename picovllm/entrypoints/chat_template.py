"""Chat templates beyond the conversation: the options a request may pass (vLLM's chat_template_kwargs and
continue_final_message) and a template given on the command line (--chat-template). No torch here: the CLI's
--help imports it."""
from __future__ import annotations

import re


CHAT_TEMPLATE_HELP = "a chat template (a file, or the Jinja text itself) used instead of the model's, as vLLM's " \
                     "--chat-template"
TRUST_TEMPLATE_HELP = "let a request's chat_template field replace the chat template (vLLM's flag: a template is " \
                      "code the server runs, in Jinja's sandbox); without it such a request is a 400"

# apply_chat_template's own arguments (and the conversation's): never template variables from chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def conversation_messages(conversation) -> list[dict]:
    """LLM.chat's conversation as a chat template takes it: each message a dict with a string role; its content a
    string, None (read as ""), or OpenAI's list of text parts (content_for_template decides how the template gets
    them); an assistant's tool_calls with their arguments as objects, as the server passes them (JSON text parsed,
    empty as {}); the other keys (name, ...) as they are. ValueError naming messages[i].<field> otherwise."""
    from picovllm.entrypoints.openai.tool_calls import template_arguments
    if not isinstance(conversation, list):
        raise ValueError("messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with a role and a content")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", "
                                     f"\"text\": ...}}) are supported")
                texts.append({"type": "text", "text": part["text"]})
            content = texts
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        message = {**m, "content": content}
        if isinstance(m.get("tool_calls"), list):
            message["tool_calls"] = [_call_with_object_arguments(c, template_arguments) for c in m["tool_calls"]]
        out.append(message)
    return out


def _call_with_object_arguments(call, template_arguments):
    """An assistant's earlier tool call with its JSON-text arguments as the server passes them
    (tool_calls.template_arguments); anything else as it is."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": template_arguments(fn["arguments"])}}


# a template that loops over a message's content (Gemma 3's `for item in message['content']`) takes its parts
_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_for_template(messages: list[dict], template: str | None) -> list[dict]:
    """The messages whose content is a list of text parts, as the template takes them: kept a list where it loops
    over a message's content (as transformers renders them, and vLLM's "openai" content format), else the texts
    joined by newlines (vLLM's "string" format: a template that prints the content would print the list)."""
    if template and _CONTENT_LOOP.search(template):
        return messages
    return [dict(m, content=joined_parts(m["content"])) if isinstance(m.get("content"), list) else m
            for m in messages]


def joined_parts(content) -> str:
    """A message's content as one text: a list of text parts joined by newlines."""
    return "\n".join(p["text"] for p in content) if isinstance(content, list) else content


def resolved_template(tokenizer, chat_template: str | None = None, tools: list | None = None) -> str | None:
    """The one template text a conversation renders with: chat_template (a request's, or LLM.chat's argument) where
    given, else the tokenizer's (None: it has none). A tokenizer with several named templates (Hermes-2-Pro's,
    Command-R's) gives its "tool_use" one when tools come and it has one, else its "default", as transformers
    picks; ValueError where it has neither."""
    if chat_template is not None:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if not isinstance(own, dict):
        return own
    name = "tool_use" if tools and "tool_use" in own else "default"
    if name not in own:
        raise ValueError(f"messages: this model has several chat templates ({', '.join(sorted(own))}) and none named "
                         f"'default': pass chat_template")
    return own[name]


def template_kwargs(conversation: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                    chat_template_kwargs: dict | None) -> dict:
    """apply_chat_template's options beyond the conversation, checked as vLLM checks them; ValueError naming the
    field (chat_template_kwargs.<name>, continue_final_message) otherwise."""
    extra = dict(chat_template_kwargs or {})
    for name in extra:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs.{name}: is an argument of its own, not a template variable")
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=false")
        if not conversation or conversation[-1].get("role") != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
    return dict(extra, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)


# OpenAI's chat reasoning_effort values and DeepSeek V4's "max", as vLLM's ChatCompletionRequest takes them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_effort_options(template: str | None, effort: str | None,
                             chat_template_kwargs: dict | None) -> tuple[str | None, dict | None]:
    """How a chat request's reasoning_effort reaches the template, as vLLM's build_chat_params passes it: as the
    template's variable of that name (GPT-OSS's), and as enable_thinking = effort != "none" (Qwen3's switch; Gemma 4's,
    off by default) unless chat_template_kwargs sets enable_thinking itself (that one wins). Returns (the effort for a
    template with a reasoning_effort variable, else None; chat_template_kwargs, with enable_thinking where the template
    reads it). ValueError naming reasoning_effort where the template reads neither: vLLM drops the variables a
    template does not use, so the effort would be silently ignored, and a field here is honoured or refused."""
    if effort is None or not template:     # (no template: the renderer's own 400)
        return effort, chat_template_kwargs
    takes_effort = re.search(r"\breasoning_effort\b", template) is not None
    takes_thinking = re.search(r"\benable_thinking\b", template) is not None
    if not (takes_effort or takes_thinking):
        raise ValueError("reasoning_effort: the chat template reads neither reasoning_effort nor enable_thinking (send "
                         "null or omit it)")
    kwargs = chat_template_kwargs
    if takes_thinking and "enable_thinking" not in (kwargs or {}):
        kwargs = dict(kwargs or {}, enable_thinking=effort != "none")
    return (effort if takes_effort else None), kwargs


def _is_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def _compiled(value: str, name: str) -> str:
    """value, once it compiles as Jinja with what transformers' templates may use: loop controls ({% break %},
    {% continue %}) and {% generation %} blocks; ValueError naming `name` otherwise."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):     # {% generation %}...{% endgeneration %}: its body (transformers marks it)
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols, Generation]).parse(value)
    except TemplateSyntaxError as e:
        raise ValueError(f"{name}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return value


def check_request_template(value: str) -> str:
    """A request's chat_template: ValueError naming the field unless it is a Jinja template that compiles."""
    if not _is_jinja(value):
        raise ValueError("chat_template: not a Jinja template (the text itself is sent, not a file name)")
    return _compiled(value, "chat_template")


def load_chat_template(value: str) -> str:
    """--chat-template's value: a file's text, or the template itself; ValueError unless it compiles as Jinja."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif not _is_jinja(value):
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return _compiled(value, "--chat-template")
