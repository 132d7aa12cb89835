"""OpenAPI description of the API key authentication (loaded from projects.api.urls)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "projects.api.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A team API key: `Authorization: Bearer aw_…`",
        }


ERROR_SCHEMA = {
    "type": "object",
    "description": "OpenAI's error object (every error the API answers).",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "by HTTP status, e.g. invalid_request_error"},
                "param": {"type": "string", "nullable": True, "description": "the (first) offending field"},
                "code": {"type": "string", "nullable": True},
                "fields": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    "description": "every bad field and its reasons",
                },
            },
        }
    },
}
ERROR_RESPONSES = {
    "4XX": "The request was refused (bad input 400, key 401, role 403, not found 404, conflict 409, "
    "body too large 413, unsupported media type 415)",
    "5XX": "A server error; X-Request-Id names the request in the log",
}


def document_errors(result: dict, generator: object, request: object, public: bool) -> dict:
    """drf-spectacular postprocessing hook: every operation documents its errors as the one error
    object (projects.api.errors), so clients and schemathesis can check error bodies too."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            for status, description in ERROR_RESPONSES.items():
                operation["responses"].setdefault(status, {"description": description, "content": reference})
    return result
