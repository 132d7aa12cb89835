"""A local MCP server over a SQLite database of fictional products, for tests and the demo tasks.

    python -m training.environments.mcp_demo.server                    # stdio
    python -m training.environments.mcp_demo.server --http --port 8765  # streamable HTTP at /mcp

The database is built in memory at start from `products.json` (shipped next to this file), so the
server needs nothing but the `mcp` package and reaches nothing outside this process.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from mcp.server.fastmcp import FastMCP

DATA = Path(__file__).with_name("products.json")
COLUMNS = ("id", "name", "category", "price", "stock", "color", "rating")


def open_database(path: Path = DATA) -> sqlite3.Connection:
    database = sqlite3.connect(":memory:", check_same_thread=False)
    database.row_factory = sqlite3.Row
    database.execute(
        "CREATE TABLE products (id TEXT PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER,"
        " color TEXT, rating REAL)"
    )
    rows = json.loads(path.read_text())
    database.executemany(
        f"INSERT INTO products VALUES ({', '.join('?' for _ in COLUMNS)})",
        [tuple(row[column] for column in COLUMNS) for row in rows],
    )
    return database


def build_server(host: str = "127.0.0.1", port: int = 8000) -> FastMCP:
    database = open_database()
    lock = threading.Lock()  # one connection; tools may run on several threads

    def query(sql: str, parameters: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with lock:
            return [dict(row) for row in database.execute(sql, parameters).fetchall()]

    server = FastMCP("artweb-products", host=host, port=port, log_level="WARNING")

    @server.tool()
    def search_products(query_text: str = "", category: str = "", max_price: float | None = None) -> str:
        """Find products whose name contains query_text, optionally in a category and at most max_price.
        Returns id, name, category and price of each match."""
        sql = "SELECT id, name, category, price FROM products WHERE name LIKE ?"
        parameters: list[Any] = [f"%{query_text}%"]
        if category:
            sql += " AND category = ?"
            parameters.append(category.lower())
        if max_price is not None:
            sql += " AND price <= ?"
            parameters.append(max_price)
        return json.dumps(query(sql + " ORDER BY id", tuple(parameters)))

    @server.tool()
    def get_product(product_id: str) -> str:
        """Everything about one product (price, stock, color, rating) by its id, e.g. P-101."""
        rows = query("SELECT * FROM products WHERE id = ?", (product_id.strip().upper(),))
        if not rows:
            raise ValueError(f"no product with id {product_id!r}")
        return json.dumps(rows[0])

    @server.tool()
    def list_categories() -> str:
        """The product categories."""
        return json.dumps(
            [row["category"] for row in query("SELECT DISTINCT category FROM products ORDER BY 1")]
        )

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    server = build_server(arguments.host, arguments.port)
    server.run("streamable-http" if arguments.http else "stdio")


if __name__ == "__main__":
    main()
