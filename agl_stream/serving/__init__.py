"""The policy server: a checkpoint behind the OpenAI API, with token ids and logprobs."""
