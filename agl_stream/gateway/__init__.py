"""The LLM gateway: OpenAI-compatible calls forwarded upstream and recorded as spans."""
