"""A small local MCP server over a SQLite database of fictional products (tests and demo tasks)."""
