"""Tool calling for /v1/chat/completions, one module a part: tools into the prompt (prompt.py: the chat template, or
a system message for templates without tool support), tool_choice into a structured output and a finished output
into content and calls (policy.py: ToolPolicy), a streamed one piece by piece (streaming.py: AutoToolStream).

Under tool_choice "auto" the calls come in the model's format (vLLM's --tool-call-parser; by default the one its
tokenizer and template speak: registry.detect_tool_parser), one module a format: hermes.py (`<tool_call>` JSON
blocks, also the system-message fallback's), glm45.py (`<arg_key>`/`<arg_value>` pairs), qwen3_coder.py
(`<function=...>`/`<parameter=...>`), llama3_json.py (bare JSON objects), mistral.py (`[TOOL_CALLS]`), deepseek.py
(deepseek_v3, deepseek_v31) and kimi_k2.py (calls sections between special-token markers). base.py holds what they
share (ToolCall, the ToolParser contract, the block and section shapes); registry.py the parsers by name.
entrypoints/openai/tool_calls.py re-exports the names the rest of picovllm imports."""
