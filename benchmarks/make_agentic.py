"""Write benchmarks/workloads/agentic.jsonl: agent sessions whose later requests repeat earlier ones' structure.

Three public task shapes, each a few multi-turn sessions run in order (`"session"`, `"turn"`):

- tool calling (the OpenAI function-calling / Berkeley Function-Calling Leaderboard shape): a tool list as JSON
  schemas, the conversation so far (user asks, assistant tool call, tool result), then the next request; the
  answer is one JSON tool call;
- text-to-SQL (the Spider / BIRD shape): a schema of CREATE TABLE statements, the session's earlier questions
  with their SQL, then the next question; the answer is one SQL query;
- code edits (the Aider / SWE-bench shape): a small Python module and an edit instruction; the answer is the
  whole updated module, and the next turn edits the module again.

Everything is written here (names, schemas, code): nothing is downloaded. Deterministic: `python
benchmarks/make_agentic.py` rewrites the same file; `--check` prints token counts with the SmolLM2 tokenizer
of an artifact (`--check exported/smollm2`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).with_name("workloads") / "agentic.jsonl"

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}},
    {"name": "search_flights", "description": "Flights between two airports on a date.",
     "parameters": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                                                     "date": {"type": "string", "format": "date"}},
                    "required": ["origin", "destination", "date"]}},
    {"name": "book_hotel", "description": "Book a hotel room.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "checkin": {"type": "string", "format": "date"},
                                                     "nights": {"type": "integer"}},
                    "required": ["city", "checkin", "nights"]}},
]

TRIPS = [  # (user, city, origin, airport, date)
    ("Plan a trip to Lisbon", "Lisbon", "Berlin", "LIS", "2025-05-12"),
    ("I want to visit Oslo", "Oslo", "Paris", "OSL", "2025-06-03"),
    ("Help me go to Madrid", "Madrid", "London", "MAD", "2025-04-20"),
    ("Organise a weekend in Vienna", "Vienna", "Zurich", "VIE", "2025-07-11"),
    ("Get me to Dublin", "Dublin", "Amsterdam", "DUB", "2025-09-02"),
]

SCHEMA = """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, signup_date DATE);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                     product_id INTEGER REFERENCES products(id), quantity INTEGER, order_date DATE);"""

SQL_SESSIONS = [
    [("How many customers signed up in 2024?", "SELECT COUNT(*) FROM customers WHERE signup_date >= '2024-01-01' AND signup_date < '2025-01-01';"),
     ("Which city has the most customers?", "SELECT city, COUNT(*) AS n FROM customers GROUP BY city ORDER BY n DESC LIMIT 1;"),
     ("List the five customers who ordered the most items.", None)],
    [("What is the average price of products in the category 'books'?", "SELECT AVG(price) FROM products WHERE category = 'books';"),
     ("Which products in 'books' cost more than that average?", "SELECT name, price FROM products WHERE category = 'books' AND price > (SELECT AVG(price) FROM products WHERE category = 'books');"),
     ("How many orders included a product from 'books'?", None)],
    [("Total revenue per product category.", "SELECT p.category, SUM(o.quantity * p.price) AS revenue FROM orders o JOIN products p ON p.id = o.product_id GROUP BY p.category;"),
     ("Total revenue per customer city.", "SELECT c.city, SUM(o.quantity * p.price) AS revenue FROM orders o JOIN products p ON p.id = o.product_id JOIN customers c ON c.id = o.customer_id GROUP BY c.city;"),
     ("Total revenue per month of 2024.", None)],
]

MODULE = '''def load_scores(path):
    scores = {}
    with open(path) as f:
        for line in f:
            name, value = line.strip().split(",")
            scores[name] = int(value)
    return scores


def top_players(scores, n):
    ranked = sorted(scores.items(), key=lambda item: item[1], reverse=True)
    return [name for name, _ in ranked[:n]]


def average(scores):
    return sum(scores.values()) / len(scores)
'''

EDITS = [
    ["Rename the function average to mean_score.", "Add type hints to every function.", "Make top_players return an empty list when n <= 0."],
    ["Skip empty lines in load_scores.", "Rename the parameter scores to table everywhere.", "Add a docstring to each function."],
    ["Make load_scores accept an optional separator argument (default ',').", "Round the result of average to 2 decimals.",
     "Rename top_players to best_players."],
]


def tool_prompts() -> list[dict]:
    header = ("You are an assistant that acts by calling tools. Tools (JSON schema):\n" + json.dumps(TOOLS) +
              "\nAnswer with exactly one tool call as JSON: {\"name\": ..., \"arguments\": {...}}.\n")
    items = []
    for number, (ask, city, origin, airport, date) in enumerate(TRIPS, 1):
        calls = [{"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}},
                 {"name": "search_flights", "arguments": {"origin": origin, "destination": airport, "date": date}},
                 {"name": "book_hotel", "arguments": {"city": city, "checkin": date, "nights": 3}}]
        results = [{"city": city, "temperature": 18, "conditions": "sunny"},
                   {"flights": [{"number": f"XY{100 + number}", "departs": "09:40", "price": 129}]}]
        asks = [f"{ask}. First, what is the weather there?", "Now find me a flight on that date.", "Book a hotel for three nights."]
        history = ""
        for turn, request in enumerate(asks):
            items.append({"id": f"tools-{number}-{turn + 1}", "session": f"tools-{number}", "turn": turn + 1, "kind": "tool-call",
                          "prompt": f"{header}Conversation so far:\n{history}User: {request}\nAssistant:", "chat": True})
            history += f"User: {request}\nAssistant: {json.dumps(calls[turn])}\n"
            if turn < len(results):
                history += f"Tool result: {json.dumps(results[turn])}\n"
    return items


def sql_prompts() -> list[dict]:
    items = []
    for number, session in enumerate(SQL_SESSIONS, 1):
        done = ""
        for turn, (question, answer) in enumerate(session, 1):
            prompt = (f"Database schema:\n{SCHEMA}\n\n{done}Question: {question}\n"
                      "Write one SQLite query that answers the question. Answer with the SQL only.")
            items.append({"id": f"sql-{number}-{turn}", "session": f"sql-{number}", "turn": turn, "kind": "sql", "prompt": prompt, "chat": True})
            if answer:
                done += f"Question: {question}\nSQL: {answer}\n\n"
    return items


def edit_prompts() -> list[dict]:
    items = []
    for number, edits in enumerate(EDITS, 1):
        for turn, edit in enumerate(edits, 1):
            prompt = (f"Here is the file scores.py:\n```python\n{MODULE}```\n{edit} "
                      "Reply with the complete updated file in one ```python block and nothing else.")
            items.append({"id": f"edit-{number}-{turn}", "session": f"edit-{number}", "turn": turn, "kind": "code-edit",
                          "prompt": prompt, "chat": True})
    return items


def interleaved(*groups: list[dict]) -> list[dict]:
    """Sessions run one after another per kind, the kinds interleaved (an agent server sees them mixed)."""
    out, queues = [], [list(g) for g in groups]
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="ARTIFACT", help="print prompt token counts with this artifact's tokenizer")
    args = parser.parse_args()
    items = interleaved(tool_prompts(), sql_prompts(), edit_prompts())
    if args.check:
        from speccompile.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(Path(args.check))
        for item in items:
            print(item["id"], len(tokenizer.prompt_ids(item["prompt"], True)))
        return
    tmp = OUT.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(item) + "\n" for item in items))
    tmp.replace(OUT)
    print(f"wrote {OUT} ({len(items)} prompts)")


if __name__ == "__main__":
    main()
