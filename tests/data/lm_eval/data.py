"""The datasets of the two local lm-eval tasks (pagoda_mc, pagoda_gen): jsonl files beside this one,
loaded without the hub (lm-eval's `custom_dataset`)."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str) -> dict:
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def load_mc(**kwargs) -> dict:
    return _load("mc.jsonl")


def load_gen(**kwargs) -> dict:
    return _load("gen.jsonl")
