"""Wire formats other clients speak: Tinker's (tinker; tinker_http, what the front checks before
loading the SDK) and OpenAI's errors and HTTP calls (openai_errors, openai_http)."""
