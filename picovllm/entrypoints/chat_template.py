"""Chat templates beyond the conversation: the options a request may pass (vLLM's chat_template_kwargs and
continue_final_message) and a template given on the command line (--chat-template). No torch here: the CLI's
--help imports it."""
from __future__ import annotations


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
    string, None (read as ""), or OpenAI's list of text parts (joined by newlines, as the server joins them); the
    other keys (tool_calls, name, ...) as they are. ValueError naming messages[i].<field> otherwise."""
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
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


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


def _is_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def _compiled(value: str, name: str) -> str:
    """value, once it compiles as Jinja; ValueError naming `name` otherwise."""
    from jinja2 import Environment, TemplateSyntaxError
    try:
        Environment().parse(value)
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
