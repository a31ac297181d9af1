"""The API plane: tokenizer and detokenizer now; the OpenAI-compatible server with [serving]."""
