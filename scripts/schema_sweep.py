"""Real-world JSON schemas through `clover serve` (issue 29): does every answer close, parse and validate?

Each schema of a sample (files of one schema each, e.g. JSONSchemaBench's data/Github_* folders:
github.com/guidance-ai/jsonschemabench; the files are not kept in this repository) goes through the
official openai client to a live server on the shipped model, at `--max-tokens` and the server's
default block size. Per schema: the HTTP status (a refusal's reason), finish_reason, whether the content
parses and validates against the schema, completion tokens. The summary counts refusals by reason,
answers that ran to the limit, invalid answers, 5xx and hangs (no answer within --timeout seconds).

    git --git-dir=/path/jsonschemabench/.git archive HEAD data/Github_medium | tar -x -C runs/jsonschemabench
    .venv/bin/python scripts/schema_sweep.py runs/jsonschemabench/data/Github_medium --n 60 --json runs/schema_sweep.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import jsonschema
import openai
import torch
from tqdm import tqdm

from cloverlm.convert.load import load_folder_tokenizer, load_model
from cloverlm.paths import MODELS
from cloverlm.serving.app import create_app
from cloverlm.serving.background import background_server
from cloverlm.serving.schemas import ServerConfig

KEY = "sweep"


def _valid(text: str, schema: dict) -> bool:
    try:
        answer = json.loads(text)
        jsonschema.validators.validator_for(schema)(schema).validate(answer)
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def _one(client, schema: dict, max_tokens: int) -> dict:
    started = time.perf_counter()
    prompt = "Write one JSON value that follows this schema, with realistic values:\n" + json.dumps(schema)[:2000]
    try:
        result = client.chat.completions.create(
            model="clover", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        )
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        return {"status": error.status_code, "reason": str(body.get("message", error))[:160], "seconds": time.perf_counter() - started}
    except openai.APITimeoutError:
        return {"status": "timeout", "seconds": time.perf_counter() - started}
    choice = result.choices[0]
    text = choice.message.content or ""
    return {"status": 200, "finish_reason": choice.finish_reason, "valid": _valid(text, schema),
            "tokens": result.usage.completion_tokens, "seconds": time.perf_counter() - started, "content": text[:300]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders of schema files (*.json)")
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    files = sorted(f for folder in args.folders for f in folder.glob("*.json"))
    sample = random.Random(args.seed).sample(files, min(args.n, len(files)))
    folder = MODELS / "smollm2-clover"
    model, tokenizer = load_model(folder), load_folder_tokenizer(folder)
    app = create_app(model, tokenizer, ServerConfig(model_name="clover", api_key=KEY, max_tokens=max(1024, args.max_tokens)))
    rows = []
    with background_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=args.timeout)
        for path in tqdm(sample, desc="schemas"):
            schema = json.loads(path.read_text())
            rows.append({"file": path.name, **_one(client, schema, args.max_tokens)})
    served = [r for r in rows if r["status"] == 200]
    summary = {
        "schemas": len(rows), "served": len(served),
        "refused_400": collections.Counter(r["reason"].split(":")[0] + (": " + r["reason"].split(":")[1][:60] if ":" in r["reason"] else "")
                                           for r in rows if r["status"] == 400),
        "server_errors_5xx": sum(isinstance(r["status"], int) and r["status"] >= 500 for r in rows),
        "hangs": sum(r["status"] == "timeout" for r in rows),
        "finish_reasons": collections.Counter(r["finish_reason"] for r in served),
        "ran_to_the_limit": [r["file"] for r in served if r["finish_reason"] == "length"],
        "invalid_answers": [r["file"] for r in served if r["finish_reason"] != "length" and not r["valid"]],
        "valid_answers": sum(r["valid"] for r in served),
        "max_tokens": args.max_tokens, "seed": args.seed, "folders": [str(f) for f in args.folders],
    }
    report = {"summary": summary, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
