"""mlcc.runtime.api: the OpenAI request layer: validation (protocol, json_body), preparation into a Call, grammars for structured output and tool calls, and the response objects."""
