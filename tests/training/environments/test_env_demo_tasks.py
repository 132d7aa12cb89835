"""The shipped demo task sets are valid task sets and answerable only through their tools."""

import json
from pathlib import Path

from projects.services.task_sets import parse_rows
from training.environments.mcp_demo.server import open_database

DEMO = Path(__file__).resolve().parents[3] / "artweb" / "demo"


def test_tool_tasks_need_the_lookup_tool_and_have_both_splits():
    text = (DEMO / "tool_tasks.jsonl").read_text()
    rows = parse_rows(jsonl=text)
    assert {row.split for row in rows} == {"train", "validation"}
    assert sum(row.split == "validation" for row in rows) == 12
    for row in rows:
        item = row.data["item"]
        *demonstration, question = row.data["messages"]
        # Two worked examples (a lookup call, its result, the answer) before the question.
        assert [m["role"] for m in demonstration] == ["user", "assistant", "tool", "assistant"] * 2
        assert question == {"role": "user", "content": f"What is the {item['key']}?"}
        assert item["facts"][item["key"]] == item["answer"]
        assert item["answer"] not in json.dumps(row.data["messages"])  # only the tool knows it
        assert len(item["facts"]) == 2  # and a decoy fact: the key must be the right one
        # The examples' calls are text, not tool_calls: graders must not count them as the model's.
        assert not any("tool_calls" in m for m in demonstration)


def test_mcp_product_tasks_match_the_demo_database():
    rows = parse_rows(jsonl=(DEMO / "mcp_products_tasks.jsonl").read_text())
    assert {row.split for row in rows} == {"train", "validation"}
    database = open_database()
    products = {row["id"]: dict(row) for row in database.execute("SELECT * FROM products")}
    for row in rows:
        product = products[row.data["item"]["product_id"]]
        assert product["name"] in row.data["prompt"]
        answers = {f"{product['price']:g}", str(product["stock"]), product["color"]}
        assert row.data["item"]["answer"] in answers | {"no"}
    assert (
        json.loads((DEMO / "mcp_products_tasks.jsonl").read_text().splitlines()[0])["item"]["answer"]
        == "34.5"
    )
