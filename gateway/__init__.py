"""The API plane: the OpenAI-compatible gateway (`app.create_app`, `server.run`), its tokenizer and detokenizer."""
