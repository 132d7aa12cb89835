"""Wire formats other clients speak: Tinker's (tinker) and OpenAI's errors and HTTP calls
(openai_errors, openai_http)."""
