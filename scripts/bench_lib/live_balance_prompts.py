"""bench_live_balance's prompt mixes: one from the trained checkpoint's held-out split, three
from outside its training corpus (the interpreter's standard library).

* ``stdlib-held-out``: runs of lines cut from the held-out stdlib files (``bench_lib/sharegpt.py``:
  text the checkpoint never saw, but of the kind it was trained on);
* ``python-apps``: 16 openings of everyday Python that is not the stdlib's (an LRU cache class,
  argparse set-up, a SQL query, asyncio fetches, ...), written here;
* ``other-code``: shell scripts, JSON and YAML, C, SQL and a Makefile;
* ``prose``: English paragraphs.

A mix's requests take its prompts in order, starting again from the first when there are fewer
prompts than requests. ``halves`` splits a mix's distinct prompts in two, one half to plan a
rebalance on and the other, which it never saw, to measure it on.
"""

from __future__ import annotations

from bench_lib import sharegpt

PYTHON_APPS = (
    "class LRUCache:\n    \"\"\"A fixed-size cache that evicts the least recently used "
    "key.\"\"\"\n\n"
    "    def __init__(self, capacity: int):\n        self.capacity = capacity\n"
    "        self._items = OrderedDict()\n\n    def get(self, key):\n",
    "import argparse\n\n\ndef parse_args():\n    parser = argparse.ArgumentParser(description="
    "\"Resize every image in a folder\")\n    parser.add_argument(\"folder\", help=\"where the "
    "images are\")\n    parser.add_argument(\"--width\", type=int, default=800)\n",
    "import sqlite3\n\n\ndef top_customers(db_path, limit=10):\n    conn = sqlite3.connect("
    "db_path)\n    cur = conn.execute(\n        \"SELECT c.name, SUM(o.total) AS spent FROM "
    "customers c JOIN orders o ON o.customer_id = c.id \"\n",
    "import asyncio\n\nimport aiohttp\n\n\nasync def fetch(session, url):\n    async with "
    "session.get(url, timeout=10) as response:\n        response.raise_for_status()\n"
    "        return await response.text()\n\n\nasync def fetch_all(urls):\n",
    "from flask import Flask, jsonify, request\n\napp = Flask(__name__)\ntodos = []\n\n\n"
    "@app.route(\"/todos\", methods=[\"POST\"])\ndef add_todo():\n    data = request."
    "get_json()\n",
    "import pandas as pd\n\ndf = pd.read_csv(\"sales.csv\", parse_dates=[\"date\"])\n"
    "monthly = (\n    df.groupby([df[\"date\"].dt.to_period(\"M\"), \"region\"])[\"amount\"]\n",
    "import pytest\n\nfrom shop.cart import Cart\n\n\n@pytest.fixture\ndef cart():\n"
    "    cart = Cart()\n    cart.add(\"apple\", price=0.5, quantity=3)\n    return cart\n\n\n"
    "def test_total(cart):\n",
    "import requests\nfrom requests.adapters import HTTPAdapter\nfrom urllib3.util.retry "
    "import Retry\n\n\ndef make_session(retries=3):\n    session = requests.Session()\n"
    "    retry = Retry(total=retries, backoff_factor=0.5,\n",
    "import numpy as np\n\n\ndef normalize_rows(matrix: np.ndarray) -> np.ndarray:\n"
    "    \"\"\"Scale every row of ``matrix`` to unit length.\"\"\"\n    norms = np.linalg.norm("
    "matrix, axis=1, keepdims=True)\n",
    "from dataclasses import dataclass, field\n\n\n@dataclass\nclass Invoice:\n"
    "    number: str\n    customer: str\n    lines: list = field(default_factory=list)\n\n"
    "    def total(self):\n",
    "import logging\nimport sys\n\n\ndef setup_logging(verbose: bool) -> logging.Logger:\n"
    "    logger = logging.getLogger(\"backup\")\n    handler = logging.StreamHandler(sys.stderr)\n",
    "class Node:\n    def __init__(self, key):\n        self.key = key\n        self.left = "
    "None\n        self.right = None\n\n\nclass BinarySearchTree:\n    def __init__(self):\n"
    "        self.root = None\n\n    def insert(self, key):\n",
    "import click\n\n\n@click.command()\n@click.option(\"--count\", default=1, help=\"Number of "
    "greetings.\")\n@click.argument(\"name\")\ndef hello(count, name):\n",
    "import csv\nimport json\n\n\ndef csv_to_json(csv_path, json_path):\n    with open("
    "csv_path, newline=\"\") as f:\n        rows = list(csv.DictReader(f))\n",
    "from concurrent.futures import ThreadPoolExecutor, as_completed\n\n\ndef "
    "download_all(urls, workers=8):\n    results = {}\n    with ThreadPoolExecutor("
    "max_workers=workers) as pool:\n",
    "import torch\nfrom torch import nn\n\n\nclass MLP(nn.Module):\n    def __init__(self, "
    "dim, hidden):\n        super().__init__()\n        self.fc1 = nn.Linear(dim, hidden)\n",
)

OTHER_CODE = (
    "#!/usr/bin/env bash\nset -euo pipefail\n\nBACKUP_DIR=/var/backups/$(date +%F)\nmkdir -p "
    "\"$BACKUP_DIR\"\nfor db in $(psql -At -c \"SELECT datname FROM pg_database\"); do\n",
    "#!/bin/sh\n# rotate the logs older than a week\nfind /var/log/app -name '*.log' -mtime +7 "
    "-print0 |\n  xargs -0 gzip\nif [ -f /var/run/app.pid ]; then\n",
    "#!/usr/bin/env bash\nfor f in *.jpg; do\n  convert \"$f\" -resize 50% \"small/${f%.jpg}"
    ".png\"\ndone\necho \"done: $(ls small | wc -l) files\"\n",
    "FROM python:3.12-slim\nWORKDIR /app\nCOPY requirements.txt .\nRUN pip install "
    "--no-cache-dir -r requirements.txt\nCOPY . .\n",
    "{\n  \"name\": \"weather-dashboard\",\n  \"version\": \"1.4.2\",\n  \"scripts\": {\n"
    "    \"start\": \"vite\",\n    \"build\": \"vite build\",\n",
    "{\"user\": {\"id\": 4182, \"email\": \"ana@example.com\", \"roles\": [\"admin\", \"editor\"],"
    "\n  \"settings\": {\"theme\": \"dark\", \"language\": \"pt-BR\",\n",
    "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\nspec:\n  replicas: 3\n"
    "  selector:\n    matchLabels:\n      app: web\n",
    "services:\n  db:\n    image: postgres:16\n    environment:\n      POSTGRES_PASSWORD: "
    "example\n  web:\n    build: .\n",
    "#include <stdio.h>\n#include <stdlib.h>\n\nint main(int argc, char **argv) {\n"
    "    if (argc < 2) {\n        fprintf(stderr, \"usage: %s FILE\\n\", argv[0]);\n",
    "struct list_node {\n    int value;\n    struct list_node *next;\n};\n\nstruct list_node "
    "*list_reverse(struct list_node *head) {\n    struct list_node *prev = NULL;\n",
    "static uint32_t crc32(const uint8_t *buf, size_t len) {\n    uint32_t crc = 0xFFFFFFFF;\n"
    "    for (size_t i = 0; i < len; i++) {\n",
    "#include <pthread.h>\n\nstatic pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;\nstatic "
    "long counter;\n\nvoid *worker(void *arg) {\n",
    "SELECT d.name AS department, COUNT(e.id) AS staff, AVG(e.salary) AS mean_salary\nFROM "
    "departments d\nLEFT JOIN employees e ON e.department_id = d.id\n",
    "CREATE TABLE orders (\n    id SERIAL PRIMARY KEY,\n    customer_id INTEGER NOT NULL "
    "REFERENCES customers(id),\n    placed_at TIMESTAMP NOT NULL DEFAULT now(),\n",
    "CC = gcc\nCFLAGS = -O2 -Wall -Wextra\nOBJS = main.o parser.o lexer.o\n\nall: calc\n\n"
    "calc: $(OBJS)\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n  <meta charset=\"utf-8\">\n  <title>Order "
    "summary</title>\n</head>\n<body>\n",
)

PROSE = (
    "The village sat at the edge of a wide grey lake, and every morning the fishermen pushed "
    "their boats out before the sun had cleared the hills. ",
    "Dear Ms. Patel, thank you for your letter of the twelfth. I am writing to confirm that "
    "your order has been shipped and should arrive within ",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into sugar. It takes place mostly in the leaves, where ",
    "To make the bread, mix the flour and salt in a large bowl, then add the warm water and "
    "yeast. Knead the dough for ten minutes until ",
    "The committee met on Tuesday to discuss the new budget. Most members agreed that the "
    "library needed more money, but ",
    "When the train finally stopped, nobody on the platform moved. The doors opened with a "
    "sigh, and a small girl in a red coat ",
    "Climate scientists warn that the next decade will decide how much the planet warms by "
    "the end of the century, because ",
    "Our hotel was a short walk from the old town, and the staff were friendly and helpful. "
    "The only problem was ",
    "In 1869 the first transcontinental railroad in the United States was completed, joining "
    "the east and the west and ",
    "My grandmother kept a garden behind her house with tomatoes, beans and a row of "
    "sunflowers taller than ",
    "The new phone has a larger screen and a better camera than last year's model, but its "
    "battery ",
    "Once upon a time there was a king who had three daughters, and the youngest was so "
    "beautiful that ",
    "The meeting is moved to Thursday at three o'clock in room 204. Please bring the sales "
    "figures for ",
    "Volcanoes form where magma from deep inside the earth rises to the surface. Some erupt "
    "violently, while others ",
    "After twenty years as a teacher, she decided to open a small bookshop on the corner of "
    "the main street, where ",
    "The team played well in the first half and led by two goals, but after the break the "
    "visitors ",
)

MIXES = ("stdlib-held-out", "python-apps", "other-code", "prose")
SHIFT_MIXES = ("stdlib-held-out", "other-code", "prose")  # the shift benchmarks' order
DESCRIBED = {
    "stdlib-held-out": "4-24 line runs of held-out stdlib files (the training corpus' split "
    "the checkpoint never saw)",
    "python-apps": f"{len(PYTHON_APPS)} openings of everyday Python outside the stdlib (LRU "
    "cache, argparse, SQL, asyncio, Flask, pandas, ...)",
    "other-code": f"{len(OTHER_CODE)} openings of shell, Dockerfile, JSON, YAML, C, SQL, "
    "Makefile and HTML",
    "prose": f"{len(PROSE)} openings of English prose",
}


def prompts(mix: str, requests: int, max_chars: int = 1200) -> list[str]:
    """``requests`` prompts of ``mix`` (one of ``MIXES``), each at most ``max_chars`` long."""
    found = _distinct(mix, requests)
    return [found[i % len(found)][:max_chars] for i in range(requests)]


def _distinct(mix: str, wanted: int) -> list[str]:
    if mix == "stdlib-held-out":
        return [c["conversations"][0]["value"] for c in sharegpt.conversations(wanted)]
    return list({"python-apps": PYTHON_APPS, "other-code": OTHER_CODE, "prose": PROSE}[mix])


def halves(mix: str, requests: int, max_chars: int = 1200) -> tuple[list[str], list[str]]:
    """The distinct prompts of ``mix`` split in two, in order: the first half (to plan on) and
    the second (to measure on), each taken in order by ``requests`` requests, cycled."""
    found = _distinct(mix, 2 * requests)
    if len(found) < 2:
        raise ValueError(f"mix {mix!r} has {len(found)} distinct prompts: two halves need 2")
    half = len(found) // 2

    def cycled(part: list[str]) -> list[str]:
        return [part[i % len(part)][:max_chars] for i in range(requests)]

    return cycled(found[:half]), cycled(found[half:])
